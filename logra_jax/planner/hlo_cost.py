"""A step's flops and bytes from its optimized HLO, with every loop counted as often as it runs.

XLA's own `compiled.cost_analysis()` counts a while loop's body once, whatever its trip count: the 28-layer scan,
the attention's key-chunk loop and the log-prob chunk loop each add one iteration, so a 1.5B train step reads as
1.7 TFLOP where ≈ 50 TFLOP run. XLA:GPU gives no cost analysis at all for a compile-only executable, and neither
compiler sees inside a Pallas kernel unless the kernel declares its cost. `hlo_cost(compiled.as_text())` walks
the compiled module instead:

- a `while` costs its body × its trip count (+ its condition × (trip count + 1)); the trip count is the one the
  compiler proved (`backend_config` "known_trip_count"); a loop without one counts once and is listed in
  `unknown_trip_counts`;
- matmul flops: `dot` 2·|out|·K, `convolution` 2·|out|·(|kernel| / output features), cuBLAS calls from their
  dot dimension numbers, and a TPU Pallas kernel's declared `cost_estimate`; a custom call with no cost
  (a Triton Pallas kernel on GPU) adds none and is listed in `uncounted_custom_calls`;
- elementwise arithmetic 1 flop per output element, reductions 1 per input element, transcendentals counted
  apart (as XLA does);
- HBM bytes accessed: what each top-level instruction reads and writes in device memory (a fusion: its operands and
  results, not its insides). A fusion operand read only through slices (dynamic-slice, slice, gather; through
  bitcasts and nested fusions, as libtpu nests the slice of a loop-carried weight stack inside the matmul's fusion)
  reads only the slices; one a nested fusion only returns (libtpu wraps a weight's bitcast in a fusion of its own
  inside the matmul's: the tied LM head of a decode step) reads what its caller reads of that fusion's output; a
  dynamic-update-slice or scatter that a fusion (or the program) returns in place writes only its update and does
  not read the buffer (a decode step's KV-cache write); so a loop over stacked [L, ...] weights reads each layer
  once, not L times per iteration. Arrays whose layout names another memory space (`S(1)`:
  the TPU's VMEM, where libtpu's memory-space assignment keeps small arrays; `S(5)`: host memory) are not HBM
  traffic; async copies and slices (`copy-start`, `slice-start`) count their HBM side once;
- collective bytes (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute, in every form: the
  synchronous op, XLA:GPU's `*-start` / `*-done` pairs, `async-start` wrappers, and libtpu's async collectives, whose
  start, continuation and done fusions each repeat the collective under one channel id): the bytes each device
  receives under ring algorithms over a group of n: all-gather its result minus its operand, reduce-scatter its
  operand minus its result, all-reduce 2·(n−1)/n × its operand, all-to-all (n−1)/n × its operand,
  collective-permute its operand; each collective counted once (a `*-done` is free). They are counted apart: the
  roofline's memory term does not include them (`logra_jax.planner.aot.roofline`).

Every dtype XLA prints is sized from its name (`f8e4m3fn` 1 byte, `f4e2m1fn` ½, `s2` ¼ ...), fp8 included.
The module is per device (SPMD-partitioned), so the figures are per device.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def f(w, x):
  ...     return jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
  >>> w, x = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32)
  >>> cost = hlo_cost(jax.jit(f).lower(w, x).compile().as_text())
  >>> cost.matmul_flops == 6 * 2 * 32 * 64 * 64, cost.unknown_trip_counts
  (True, ())
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

_FIXED_BYTES = {"pred": 1.0, "token": 0.0, "bf16": 2.0, "tf32": 4.0, "c64": 8.0, "c128": 16.0}
_SIZED = re.compile(r"[suf](\d+)(?:e\d+m\d+[a-z]*)?")  # s4, u8, f16, f8e4m3fn, f8e5m2fnuz, f8e8m0fnu, f4e2m1fn ...
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP = re.compile(r"\s*([a-z][\w\-]*)\(")

ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "sign", "compare", "select",
    "and", "or", "xor", "not", "clamp", "remainder", "floor", "ceil", "round-nearest-afz", "round-nearest-even",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "atan2", "is-finite", "stochastic-convert"})
TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "power", "sine", "cosine", "tan", "erf"})
# the collectives, by their synchronous names; `<name>-start` is the same collective begun asynchronously
COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                         "ragged-all-to-all", "collective-broadcast"})
# instructions that move no data of their own (their callees, if any, are counted); every `*-done` is free too
_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
                   "after-all", "partition-id", "replica-id", "opt-barrier", "async-update", "add-dependency",
                   "domain", "iota"})
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
# custom calls that run a kernel of their own (their flops are unknown unless declared); every other target
# (the TPU's AsyncCollectiveStart, ...) moves or annotates data
_KERNEL_CALLS = frozenset({"tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call"})
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# custom calls that neither read nor write device memory (a buffer's allocation, a sharding annotation)
_NO_TRAFFIC_CALLS = frozenset({"AllocateBuffer", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
# the custom call by which libtpu starts an async collective (fused with the collective it starts)
_TPU_ASYNC_START = "AsyncCollectiveStart"
# What a fused computation reads of a parameter it only returns (through bitcasts): what its caller reads of it.
_PASS = "returned"


@dataclasses.dataclass(frozen=True)
class HloCost:
    """Per-device cost of one compiled module, every loop iteration counted."""

    flops: float  # matmul + elementwise + reduction flops
    matmul_flops: float  # dot / convolution / cuBLAS / declared Pallas flops alone
    transcendentals: float
    bytes_accessed: float  # HBM bytes read + written by top-level instructions (collectives excluded)
    collective_bytes: float  # bytes moved by collectives, per device
    unknown_trip_counts: tuple[str, ...] = ()  # while loops counted once: no trip count known to the compiler
    # One iteration of those loops, part of the totals above: (flops, HBM bytes, collective bytes). A program that
    # runs such a loop k times costs the totals + (k − 1) × this.
    unknown_loop_iteration: tuple[float, float, float] = (0.0, 0.0, 0.0)
    uncounted_custom_calls: tuple[str, ...] = ()  # custom calls that declare no flops (e.g. Triton Pallas on GPU)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class _Cost:
    flops: float = 0.0
    matmul: float = 0.0
    trans: float = 0.0
    bytes: float = 0.0
    coll: float = 0.0
    unknown: tuple[str, ...] = ()
    uncounted: tuple[str, ...] = ()
    # One iteration of the loops without a known trip count (flops, bytes, collective bytes): part of the above.
    loop: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def add(self, other: _Cost, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.matmul += times * other.matmul
        self.trans += times * other.trans
        self.bytes += times * other.bytes
        self.coll += times * other.coll
        self.unknown += other.unknown
        self.uncounted += other.uncounted
        self.loop = tuple(a + times * b for a, b in zip(self.loop, other.loop))


def _dtype_bytes(dtype: str) -> float | None:
    """Bytes per element of an HLO element type, from its name (None: not an array type, e.g. a layout token)."""
    if dtype in _FIXED_BYTES:
        return _FIXED_BYTES[dtype]
    sized = _SIZED.fullmatch(dtype)
    return int(sized.group(1)) / 8 if sized else None


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, dims, memory space) of every array in a (possibly tuple) HLO shape; memory space 0 is HBM."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        if _dtype_bytes(dtype) is None:
            continue
        sizes = tuple(int(re.sub(r"\D", "", d) or 0) for d in dims.split(",") if d.strip())  # "<=8": 8
        space = _SPACE.search(layout or "")
        out.append((dtype, sizes, int(space.group(1)) if space else 0))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (tuple shapes: the sum of their arrays), whatever memory they live in.

    >>> shape_bytes("(f32[2,3]{1,0}, bf16[4]{0}, f8e4m3fn[8]{0})")
    40.0
    """
    return float(sum(_dtype_bytes(dtype) * math.prod(dims) for dtype, dims, _ in _arrays(shape)))


def _hbm_bytes(shape: str) -> float:
    """Bytes of the arrays of `shape` that live in device memory (memory space 0)."""
    return float(sum(_dtype_bytes(dtype) * math.prod(dims) for dtype, dims, space in _arrays(shape) if space == 0))


def _in_hbm(shape: str) -> bool:
    """Whether the (first) array of `shape` lives in device memory."""
    arrays = _arrays(shape)
    return not arrays or arrays[0][2] == 0


def _elements(shape: str) -> int:
    arrays = _arrays(shape)
    return math.prod(arrays[0][1]) if arrays else 0


def _logical(shape: str) -> tuple:
    """A shape without its layouts: (dtype, dims) of each array (for comparing a collective's repeats)."""
    return tuple((dtype, dims) for dtype, dims, _ in _arrays(shape))


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (`shape` itself, alone, when it is not a tuple)."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, start = [], 1
    for i, depth in _depths(shape):
        if (shape[i] == "," and depth == 1) or (i == len(shape) - 1 and depth == 0):
            if shape[start:i].strip():
                out.append(shape[start:i].strip())
            start = i + 1
    return out


def _depths(text: str, start: int = 0):
    """(index, bracket depth after that character) along `text` from `start`; brackets inside "strings" (a
    backend_config's JSON values) do not count."""
    depth, i, quoted = 0, start, False
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        yield i, depth
        i += 1


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start`."""
    for i, depth in _depths(text, start):
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 200]!r}")


def _parse_instr(line: str) -> _Instr | None:
    match = _INSTR.match(line)
    if not match:
        return None
    name, rest = match.group(2), match.group(3)
    if rest.startswith("("):  # a tuple shape
        end = _matching(rest, 0)
    else:
        end = rest.find(" ")
    shape, rest = rest[:end], rest[end:]
    op = _OP.match(rest)
    if not op:
        return None
    open_paren = op.end() - 1
    close = _matching(rest, open_paren)
    operands = []
    depth, current = 0, ""
    for ch in re.sub(r"/\*.*?\*/", "", rest[open_paren + 1:close - 1]) + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            token = current.strip().split(" ")[-1] if current.strip() else ""
            if token:
                operands.append(token.lstrip("%"))
            current = ""
        else:
            current += ch
    return _Instr(name, shape, op.group(1), operands, rest[close:])


def _unclosed(text: str) -> int:
    """Brackets left open at the end of `text`."""
    return functools.reduce(lambda _, step: step[1], _depths(text), 0)


def _lines(text: str) -> list[str]:
    """The module's lines, an instruction whose attributes span several lines (a TPU kernel's pretty-printed
    backend_config) joined into one."""
    out, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending} {line.strip()}" if pending else line
        if _INSTR.match(pending) and _unclosed(pending):
            continue
        out.append(pending)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _parse(text: str) -> tuple[dict[str, list[_Instr]], dict[str, str], str]:
    """{computation: instructions}, {computation: its root's name}, the entry computation's name."""
    computations: dict[str, list[_Instr]] = {}
    roots: dict[str, str] = {}
    entry, name, current = "", "", None
    for line in _lines(text):
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(2)
            current = computations.setdefault(name, [])
            if header.group(1):
                entry = name
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                current.append(instr)
                if line.lstrip().startswith("ROOT "):
                    roots[name] = instr.name
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text (expected `compiled.as_text()` of a jitted function)")
    return computations, roots, entry


def _attr(attrs: str, key: str) -> str | None:
    """The value of `key=` in an attribute string (a bracketed value whole, a string unquoted)."""
    match = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
    if not match:
        return None
    start = match.end()
    if start < len(attrs) and attrs[start] in "{[(":
        return attrs[start:_matching(attrs, start)]
    if start < len(attrs) and attrs[start] == '"':
        end = start + 1
        while end < len(attrs) and not (attrs[end] == '"' and attrs[end - 1] != "\\"):
            end += 1
        return attrs[start + 1:end].replace('\\"', '"')
    return re.match(r"[^,\s]*", attrs[start:]).group(0)


def _callees(attrs: str, key: str) -> list[str]:
    value = _attr(attrs, key)
    return [] if value is None else [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]


def _window(value: str) -> dict[str, list]:
    """A convolution's window attribute: {"size": [2, 2], "pad": [(0, 0), (1, 1)], "lhs_dilate": [2, 1], ...}."""
    out: dict[str, list] = {}
    for key, spec in re.findall(r"(\w+)=([\w\-]+)", value.strip("{}")):
        parts = spec.split("x")
        out[key] = [tuple(int(v) for v in p.split("_")) for p in parts] if key == "pad" else \
            [int(p) for p in parts if re.fullmatch(r"-?\d+", p)]
    return out


def _dims(value: str | None) -> list[int]:
    return [] if not value else [int(v) for v in value.strip("{}").split(",") if v.strip()]


def _json(attrs: str) -> dict:
    value = _attr(attrs, "backend_config")
    if not value:
        return {}
    try:
        return json.loads(value)
    except ValueError:
        return {}


def _convolution_fmas(lhs_shape: str, rhs_shape: str, instr: _Instr) -> float:
    """Multiply-adds of a convolution as XLA counts them: output batch × output features × input features per
    group × the (output, window) position pairs that land on a real input element in every spatial dim
    (not padding, not a dilation hole). The TPU compiler writes batched matmuls as such convolutions."""
    lhs, rhs = _arrays(lhs_shape), _arrays(rhs_shape)
    out = _arrays(instr.shape)
    labels = re.fullmatch(r"(\w+)_(\w+)->(\w+)", _attr(instr.attrs, "dim_labels") or "")
    if not (lhs and rhs and out and labels):
        return 0.0
    (lhs_dims, rhs_dims, out_dims), (lhs_l, rhs_l, out_l) = (lhs[0][1], rhs[0][1], out[0][1]), labels.groups()
    window = _window(_attr(instr.attrs, "window") or "")
    fmas = float(out_dims[out_l.index("b")] * out_dims[out_l.index("f")] * rhs_dims[rhs_l.index("i")])
    for j, label in enumerate(c for c in rhs_l if c.isdigit()):
        size, kernel, outsize = lhs_dims[lhs_l.index(label)], rhs_dims[rhs_l.index(label)], \
            out_dims[out_l.index(label)]
        get = (lambda key, default, j=j: window[key][j] if key in window and j < len(window[key]) else default)
        stride, lhs_dilate, rhs_dilate = get("stride", 1), get("lhs_dilate", 1), get("rhs_dilate", 1)
        pad_lo = get("pad", (0, 0))[0]
        dilated = (size - 1) * lhs_dilate + 1
        valid = 0
        for o in range(outsize):
            for k in range(kernel):
                pos = o * stride - pad_lo + k * rhs_dilate
                valid += 0 <= pos < dilated and pos % lhs_dilate == 0
        fmas *= valid
    return fmas


def _group_size(instr: _Instr, devices: int) -> int | None:
    """Devices in each of a collective's replica groups: `{{0,1},{2,3}}`, `[2,4]<=[8]` (iota: the last
    dimension), `mesh['a'=2,'b'=4] {'b'}` (the named axes' product) or `{}` (every one of `devices`)."""
    text = instr.attrs
    at = text.find("replica_groups=")
    if at < 0:
        return None
    value = text[at + len("replica_groups="):].lstrip()
    mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", value)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", mesh.group(1))}
        named = re.findall(r"'?([\w.\-]+)'?", mesh.group(2))
        return math.prod(sizes.get(a, 1) for a in named) if named and all(a in sizes for a in named) else None
    if value.startswith("["):
        dims = _dims(value[:value.find("]") + 1].strip("[]"))
        return dims[-1] if dims else None
    if value.startswith("{"):
        groups = re.findall(r"\{([\d,\s]*)\}", value[:_matching(value, 0)])
        first = [g for g in groups if g.strip()]
        return len(_dims(first[0])) if first else (devices if devices > 1 else None)
    return None


class _Module:
    """A parsed HLO module and the per-device cost of its computations (each computed once)."""

    def __init__(self, text: str):
        self.computations, self.roots, self.entry = _parse(text)
        self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.computations.items()}
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}
        self.memo: dict[tuple[str, bool], _Cost] = {}
        self.fusion_memo: dict[str, tuple[dict[int, float | str | None], dict[int, tuple[int, float]]]] = {}
        header = text[:text.find("\n")] if "\n" in text else text
        partitions, replicas = (re.search(key + r"=(\d+)", header) for key in ("num_partitions", "replica_count"))
        # the devices of a collective whose replica_groups are empty ({}: every device)
        self.devices = (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas else 1)
        # libtpu's async collectives: the collective is repeated in the fusion that starts it (consumed by an
        # AsyncCollectiveStart custom call), in continuation fusions (possibly inside an inner loop) and in the done
        # fusion; it is counted where it starts
        self.async_started = {self.collective_key(c, o) for c, instrs in self.computations.items() for i in instrs
                              if i.op == "custom-call" and _attr(i.attrs, "custom_call_target") == _TPU_ASYNC_START
                              for o in i.operands if o in self.by_name[c] and self.by_name[c][o].op in COLLECTIVES}

    def operand_shape(self, comp: str, name: str) -> str:
        return self.shapes[comp].get(name, "")

    def cost(self, comp: str, fused: bool) -> _Cost:
        """The cost of one computation (computed once): `fused` (inside a fusion) counts flops only."""
        if (comp, fused) not in self.memo:
            total = _Cost()
            for instr in self.computations[comp]:
                total.add(self.instr_cost(comp, instr, fused))
            self.memo[comp, fused] = total
        return self.memo[comp, fused]

    def matmul_flops(self, comp: str, instr: _Instr) -> float:
        out = _elements(instr.shape)
        if instr.op == "dot":
            lhs = _arrays(self.operand_shape(comp, instr.operands[0]))
            if not lhs:
                return 0.0
            contracted = math.prod(lhs[0][1][d] for d in _dims(_attr(instr.attrs, "lhs_contracting_dims")))
            return 2.0 * out * contracted
        if instr.op == "convolution":
            return 2.0 * _convolution_fmas(*(self.operand_shape(comp, o) for o in instr.operands[:2]), instr)
        return 0.0

    def constant(self, comp: str, name: str) -> int | None:
        """The value of an integer scalar constant (through copies), else None."""
        instr = next((i for i in self.computations[comp] if i.name == name), None)
        while instr is not None and instr.op == "copy" and instr.operands:
            instr = next((i for i in self.computations[comp] if i.name == instr.operands[0]), None)
        if instr is None or instr.op != "constant" or not re.fullmatch(r"-?\d+", instr.operands[0] if
                                                                        instr.operands else ""):
            return None
        return int(instr.operands[0])

    def counted_loop_trips(self, comp: str, instr: _Instr) -> int | None:
        """The trip count of a counted loop the compiler did not annotate (TPU: `lax.map` inside a jitted call):
        its condition is `counter < N` on a tuple element whose initial value is a constant, and its body adds 1
        to that element (JAX's scan / map / fori_loop)."""
        (cond,), (body,) = _callees(instr.attrs, "condition") or [""], _callees(instr.attrs, "body") or [""]
        if cond not in self.computations or body not in self.computations or not instr.operands:
            return None
        root = next((i for i in self.computations[cond] if i.name == self.roots.get(cond)), None)
        if root is None or root.op != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
            return None
        counter = next((i for i in self.computations[cond] if i.name == root.operands[0]), None)
        limit = self.constant(cond, root.operands[1])
        if counter is None or counter.op != "get-tuple-element" or limit is None:
            return None
        index = int(_attr(counter.attrs, "index") or -1)
        init_tuple = next((i for i in self.computations[comp] if i.name == instr.operands[0]), None)
        if init_tuple is None or init_tuple.op != "tuple" or not 0 <= index < len(init_tuple.operands):
            return None
        start = self.constant(comp, init_tuple.operands[index])
        return None if start is None else max(limit - start, 0)

    def custom_call(self, comp: str, instr: _Instr) -> _Cost:
        target = _attr(instr.attrs, "custom_call_target") or ""
        cost = _Cost()
        config = _json(instr.attrs)
        if target in _CUBLAS:
            numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            lhs = _arrays(self.operand_shape(comp, instr.operands[0]))
            out = _arrays(instr.shape)
            if lhs and out:
                contracted = math.prod(lhs[0][1][int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
                cost.matmul = 2.0 * math.prod(out[0][1]) * contracted
        elif "cost_estimate" in config.get("custom_call_config", config):  # a Pallas TPU kernel's declared cost
            estimate = config.get("custom_call_config", config)["cost_estimate"]
            cost.matmul = float(estimate.get("flops", 0))
            cost.trans = float(estimate.get("transcendentals", 0))
        elif target in _KERNEL_CALLS or target.startswith("__cudnn"):
            cost.uncounted = (f"{target}:{instr.name}",)
        cost.flops = cost.matmul
        return cost

    def through_bitcasts(self, comp: str, name: str) -> str:
        """The instruction `name` is a bitcast (or a chain of bitcasts) of."""
        instr = self.by_name[comp].get(name)
        while instr is not None and instr.op == "bitcast" and instr.operands:
            name = instr.operands[0]
            instr = self.by_name[comp].get(name)
        return name

    def fusion_summary(self, callee: str) -> tuple[dict[int, float | str | None], dict[int, tuple[int, float]]]:
        """What fused computation `callee` reads of each parameter and which outputs it updates in place.

        Returns ({parameter index: bytes read, None when read whole, or `_PASS` when only returned}, {output index:
        (parameter index, update bytes)}). A parameter is read in part when every use (through bitcasts) is the
        sliced operand of a slice, dynamic-slice or gather (its slices' bytes), the operand of a nested fusion that
        reads it in part (that fusion's bytes) or returns it (what this computation reads of that fusion's output),
        or the buffer of a dynamic-update-slice the fusion returns (in place: nothing read). An
        output is updated in place when it is (through bitcasts) a dynamic-update-slice of a parameter, or a
        nested fusion's in-place output whose buffer is a parameter: it writes only the update.
        """
        if callee in self.fusion_memo:
            return self.fusion_memo[callee]
        params = {i.name: int(i.operands[0]) for i in self.computations[callee] if i.op == "parameter" and
                  i.operands and i.operands[0].isdigit()}
        in_place, in_place_users = self.fusion_in_place(callee, params)
        users: dict[str, list[_Instr]] = {}
        for i in self.computations[callee]:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        reads = {index: self.fusion_read(name, users, in_place_users, self.roots.get(callee, ""))
                 for name, index in params.items()}
        self.fusion_memo[callee] = (reads, in_place)
        return reads, in_place

    def fusion_in_place(self, callee: str, params: dict[str, int]
                        ) -> tuple[dict[int, tuple[int, float]], set[tuple[str, str]]]:
        """The outputs of fused computation `callee` updated in place ({output index: (parameter index, update
        bytes)}) and the (instruction, the name it reads) pairs that update them."""
        by_name = self.by_name[callee]
        root = by_name.get(self.roots.get(callee, ""))
        outputs = root.operands if root is not None and root.op == "tuple" else [root.name] if root else []
        in_place: dict[int, tuple[int, float]] = {}
        in_place_users: set[tuple[str, str]] = set()
        for k, out in enumerate(outputs):
            node = by_name.get(self.through_bitcasts(callee, out))
            if node is None or not node.operands:
                continue
            if node.op in ("dynamic-update-slice", "scatter") and len(node.operands) > 1:
                buffer = self.through_bitcasts(callee, node.operands[0])
                update = node.operands[1] if node.op == "dynamic-update-slice" else node.operands[-1]
                if buffer in params:
                    in_place[k] = (params[buffer], shape_bytes(self.operand_shape(callee, update)))
                    in_place_users.add((node.name, node.operands[0]))
            elif node.op == "fusion" and _callees(node.attrs, "calls"):
                (nested,) = _callees(node.attrs, "calls")[:1]
                inner = self.fusion_summary(nested)[1].get(0) if nested in self.computations else None
                if inner is not None and inner[0] < len(node.operands):
                    buffer = self.through_bitcasts(callee, node.operands[inner[0]])
                    if buffer in params:
                        in_place[k] = (params[buffer], inner[1])
                        in_place_users.add((node.name, node.operands[inner[0]]))
        return in_place, in_place_users

    def fusion_read(self, param: str, users: dict[str, list[_Instr]], in_place_users: set[tuple[str, str]],
                    root: str = "") -> float | str | None:
        """The bytes a fused computation reads of its parameter `param` (`users`: its instructions by the names
        they read; `root`: the name of its root), None when it reads it whole, or `_PASS` when the computation only
        returns it (through bitcasts) as its single output: then it reads what its caller reads of that output
        (libtpu wraps a weight's bitcast in a fusion of its own, nested in the matmul's fusion)."""

        def uses(name: str) -> list[tuple[_Instr | None, str]]:
            """(user, the name it reads): the non-bitcast users of `name` and of its bitcasts; (None, name) where
            `name` is the root."""
            out: list[tuple[_Instr | None, str]] = [(None, name)] if name == root else []
            for user in users.get(name, []):
                out += uses(user.name) if user.op == "bitcast" else [(user, name)]
            return out

        def read(name: str) -> float | str | None:
            total, passed = 0.0, False
            for user, via in uses(name):
                if user is None:
                    passed = True
                    continue
                if (user.name, via) in in_place_users and user.operands.count(via) == 1:
                    continue
                if user.op in _SLICES and user.operands[0] == via and user.operands.count(via) == 1:
                    total += shape_bytes(user.shape)
                    continue
                nested = _callees(user.attrs, "calls") if user.op == "fusion" else []
                if nested and nested[0] in self.computations:
                    part = self.fusion_summary(nested[0])[0]
                    positions = [k for k, o in enumerate(user.operands) if o == via]
                    if positions == [positions[0]] and part.get(positions[0]) is _PASS:
                        inner = read(user.name)  # the nested fusion's output is this operand, bitcast
                        if inner is None or inner is _PASS:
                            return None
                        total += inner
                        continue
                    if all(part.get(k) is not None and part.get(k) is not _PASS for k in positions):
                        total += sum(part[k] for k in positions)
                        continue
                return None
            if passed:
                return _PASS if total == 0.0 and len(uses(name)) == 1 else None
            return total

        return read(param)

    def fusion_bytes(self, comp: str, instr: _Instr, callee: str) -> float:
        """The HBM bytes a fusion reads and writes: parameters read in part count their slices, outputs updated in
        place their updates; operands and outputs outside HBM count nothing."""
        reads, in_place = self.fusion_summary(callee)
        total = 0.0
        for index, operand in enumerate(instr.operands):
            shape = self.operand_shape(comp, operand)
            part = reads.get(index)
            total += _hbm_bytes(shape) if part is None or part is _PASS else part * _in_hbm(shape)
        outputs = _tuple_elements(instr.shape) if in_place else [instr.shape]
        for k, out in enumerate(outputs):
            total += in_place[k][1] * _in_hbm(out) if k in in_place else _hbm_bytes(out)
        return total

    def collective_bytes(self, comp: str, instr: _Instr, op: str) -> float:
        """Bytes one device receives in collective `op` (the synchronous name of `instr`, which may be a
        `*-start`) under ring algorithms over its group of n; n unknown counts (n − 1)/n as 1."""
        started = instr.op.endswith("-start")
        operands = instr.operands[:1] if op in ("collective-permute", "ragged-all-to-all") else instr.operands
        sent = sum(shape_bytes(self.operand_shape(comp, o)) for o in operands)
        result = shape_bytes(instr.shape)
        if started and instr.shape.lstrip().startswith("("):  # (operands, result[, context]) of an async start
            elements = _tuple_elements(instr.shape)
            result = shape_bytes(elements[1]) if len(elements) > 1 else result
        n = _group_size(instr, self.devices)
        share = (n - 1) / n if n else 1.0
        if op == "all-gather":
            return max(result - sent, 0.0)
        if op == "reduce-scatter":
            return max(sent - result, 0.0)
        if op == "all-reduce":
            return 2.0 * share * sent
        if op in ("all-to-all", "ragged-all-to-all", "collective-broadcast"):
            return share * sent
        return sent if _attr(instr.attrs, "source_target_pairs") not in ("{}", "") else 0.0

    def collective_key(self, comp: str, name: str) -> tuple:
        """What the repeats of one libtpu async collective share: op, channel, chain and logical shape."""
        instr = self.by_name[comp][name]
        return (instr.op, _attr(instr.attrs, "channel_id"), _attr(_attr(instr.attrs, "frontend_attributes") or "",
                                                                   "chain_id"), _logical(instr.shape))

    def collective(self, comp: str, instr: _Instr, op: str) -> _Cost:
        """A collective's bytes, once: nothing for the repeats of a libtpu async collective outside the fusion
        that starts it."""
        cost = _Cost()
        if op == instr.op and self.collective_key(comp, instr.name) in self.async_started:
            started = any(instr.name in i.operands and _attr(i.attrs, "custom_call_target") == _TPU_ASYNC_START
                          for i in self.computations[comp] if i.op == "custom-call")
            if not started:
                return cost
        cost.coll = self.collective_bytes(comp, instr, op)
        return cost

    def op_bytes(self, comp: str, op: str, shape: str, operands: list[str]) -> float:
        """HBM bytes of one top-level instruction `op` with result `shape`: slices read what they take, an
        in-place update writes its update; arrays outside HBM count nothing."""
        operand_shapes = [self.operand_shape(comp, o) for o in operands]
        if op in _SLICES and operand_shapes:
            return shape_bytes(shape) * _in_hbm(operand_shapes[0]) + _hbm_bytes(shape) + \
                sum(_hbm_bytes(s) for s in operand_shapes[1:] if op == "gather")
        if op == "dynamic-update-slice" and len(operand_shapes) > 1:
            return _hbm_bytes(operand_shapes[1]) + shape_bytes(operand_shapes[1]) * _in_hbm(operand_shapes[0])
        if op == "scatter" and len(operand_shapes) > 2:  # in place: reads indices and updates, writes the updates
            return sum(_hbm_bytes(x) for x in operand_shapes[1:]) + \
                shape_bytes(operand_shapes[-1]) * _in_hbm(operand_shapes[0])
        return _hbm_bytes(shape) + sum(_hbm_bytes(s) for s in operand_shapes)

    def instr_cost(self, comp: str, instr: _Instr, fused: bool) -> _Cost:
        """One instruction's cost: a control-flow op's is its computations' (`structured_cost`); another's is its
        own flops plus, outside a fusion, its HBM traffic."""
        structured = self.structured_cost(comp, instr, fused)
        if structured is not None:
            return structured
        cost = self.compute_cost(comp, instr)
        no_traffic = instr.op == "custom-call" and _attr(instr.attrs, "custom_call_target") in _NO_TRAFFIC_CALLS
        if not (no_traffic or fused or instr.op in _FREE or instr.op.endswith("-done")):
            cost.bytes = self.traffic_bytes(comp, instr)
        return cost

    def structured_cost(self, comp: str, instr: _Instr, fused: bool) -> _Cost | None:
        """The cost of an instruction that runs other computations (a loop, a branch, a fusion, a call) or of a
        collective; None for any other instruction."""
        op = instr.op
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op == "while":
            return self.loop_cost(comp, instr, fused)
        cost = _Cost()
        if op == "conditional":
            branches = (_callees(instr.attrs, "branch_computations") or
                        _callees(instr.attrs, "true_computation") + _callees(instr.attrs, "false_computation"))
            costs = [self.cost(b, fused) for b in branches]
            if costs:
                cost.add(max(costs, key=lambda c: (c.flops, c.bytes)))
            return cost
        if op == "fusion":
            for callee in _callees(instr.attrs, "calls"):
                cost.add(self.cost(callee, True))
                if not fused:
                    cost.bytes += self.fusion_bytes(comp, instr, callee)
            return cost
        if base in COLLECTIVES:
            return self.collective(comp, instr, base)
        if op in ("call", "async-start") or _attr(instr.attrs, "calls"):
            for callee in _callees(instr.attrs, "to_apply") + _callees(instr.attrs, "calls"):
                if callee in self.computations:
                    cost.add(self.cost(callee, fused))
            return cost
        return None

    def loop_cost(self, comp: str, instr: _Instr, fused: bool) -> _Cost:
        """A while loop's body and condition times its trip count (annotated, or found by `counted_loop_trips`);
        a loop of unknown count is counted once and named."""
        cost = _Cost()
        trip = _json(instr.attrs).get("known_trip_count", {}).get("n")
        if trip is None:
            trip = self.counted_loop_trips(comp, instr)
        times = int(trip) if trip is not None else 1
        if trip is None:
            cost.unknown = (instr.name,)
        for body in _callees(instr.attrs, "body"):
            cost.add(self.cost(body, fused), times)
        for cond in _callees(instr.attrs, "condition"):
            cost.add(self.cost(cond, fused), times + 1)
        if trip is None:  # one iteration of a loop whose count only the run knows (a decode loop)
            cost.loop = (cost.flops, cost.bytes, cost.coll)
        return cost

    def compute_cost(self, comp: str, instr: _Instr) -> _Cost:
        """The flops (matmul, elementwise, reductions) and transcendentals of one instruction, without bytes."""
        op = instr.op
        if op == "custom-call":
            return self.custom_call(comp, instr)
        cost = _Cost()
        if op in ("dot", "convolution"):
            cost.matmul = self.matmul_flops(comp, instr)
            cost.flops = cost.matmul
        elif op in ELEMENTWISE:
            cost.flops = float(_elements(instr.shape))
        elif op in TRANSCENDENTAL:
            cost.trans = float(_elements(instr.shape))
        elif op == "scatter":  # the combiner runs once per update element
            cost.flops = float(_elements(self.operand_shape(comp, instr.operands[-1]))) if instr.operands else 0.0
        elif op in ("reduce", "reduce-window", "select-and-scatter"):
            cost.flops = float(_elements(self.operand_shape(comp, instr.operands[0]))) if instr.operands else 0.0
        return cost

    def traffic_bytes(self, comp: str, instr: _Instr) -> float:
        """The HBM bytes of one top-level instruction, an async op's (`*-start`) taken from its result tuple."""
        op = instr.op
        base = op[:-len("-start")] if op.endswith("-start") else op
        if op == "copy-start":  # (destination, source, context): the copy reads its source, writes its destination
            return sum(_hbm_bytes(self.operand_shape(comp, o)) for o in instr.operands) + \
                _hbm_bytes(_tuple_elements(instr.shape)[0])
        if op != base:  # an async op (slice-start, ...): ((operands), result, context)
            elements = _tuple_elements(instr.shape)
            return self.op_bytes(comp, base, elements[1] if len(elements) > 1 else instr.shape, instr.operands)
        return self.op_bytes(comp, op, instr.shape, instr.operands)


def hlo_cost(text: str) -> HloCost:
    """The per-device cost of an optimized HLO module (`compiled.as_text()`), loops counted by trip count."""
    module = _Module(text)
    total = module.cost(module.entry, False)
    return HloCost(flops=total.flops, matmul_flops=total.matmul, transcendentals=total.trans,
                   bytes_accessed=total.bytes, collective_bytes=total.coll,
                   unknown_trip_counts=tuple(dict.fromkeys(total.unknown)), unknown_loop_iteration=total.loop,
                   uncounted_custom_calls=tuple(dict.fromkeys(total.uncounted)))
