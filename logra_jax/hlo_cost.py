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
- bytes accessed: what each top-level instruction reads and writes (a fusion: its operands and results, not its
  insides); a slice taken inside a fusion reads only the slice, and a dynamic-update-slice in place writes only
  the update, so a loop over stacked [L, ...] weights reads each layer once, not L times per iteration;
- collective bytes (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute): the bytes each device
  receives or sends per collective, counted apart: the roofline's memory term does not include them.

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

_DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
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
COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                         "all-gather-start", "all-reduce-start", "collective-permute-start", "ragged-all-to-all"})
# instructions that move no data of their own (their callees, if any, are counted)
_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
                   "after-all", "partition-id", "replica-id", "opt-barrier", "all-gather-done", "all-reduce-done",
                   "collective-permute-done", "async-done", "async-update", "copy-done", "send-done", "recv-done",
                   "add-dependency", "domain", "iota"})
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
# custom calls that run a kernel of their own (their flops are unknown unless declared); every other target
# (AllocateBuffer, Sharding, the TPU's AsyncCollectiveStart, ...) moves or annotates data
_KERNEL_CALLS = frozenset({"tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call"})
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


@dataclasses.dataclass(frozen=True)
class HloCost:
    """Per-device cost of one compiled module, every loop iteration counted."""

    flops: float  # matmul + elementwise + reduction flops
    matmul_flops: float  # dot / convolution / cuBLAS / declared Pallas flops alone
    transcendentals: float
    bytes_accessed: float  # HBM bytes read + written by top-level instructions (collectives excluded)
    collective_bytes: float  # bytes moved by collectives, per device
    unknown_trip_counts: tuple[str, ...] = ()  # while loops counted once: no trip count known to the compiler
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

    def add(self, other: _Cost, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.matmul += times * other.matmul
        self.trans += times * other.trans
        self.bytes += times * other.bytes
        self.coll += times * other.coll
        self.unknown += other.unknown
        self.uncounted += other.uncounted


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of every array in a (possibly tuple) HLO shape."""
    out = []
    for dtype, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", shape)):
        if dtype not in _DTYPE_BYTES:
            continue
        out.append((dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())))
    return out


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (tuple shapes: the sum of their arrays).

    >>> shape_bytes("(f32[2,3]{1,0}, bf16[4]{0})")
    32.0
    """
    return float(sum(_DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in _arrays(shape)))


def _elements(shape: str) -> int:
    arrays = _arrays(shape)
    return math.prod(arrays[0][1]) if arrays else 0


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


class _Module:
    def __init__(self, text: str):
        self.computations, self.roots, self.entry = _parse(text)
        self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.computations.items()}
        self.memo: dict[tuple[str, bool], _Cost] = {}

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
            return 2.0 * self.convolution_fmas(comp, instr)
        return 0.0

    def convolution_fmas(self, comp: str, instr: _Instr) -> float:
        """Multiply-adds of a convolution as XLA counts them: output batch × output features × input features per
        group × the (output, window) position pairs that land on a real input element in every spatial dim
        (not padding, not a dilation hole). The TPU compiler writes batched matmuls as such convolutions."""
        lhs, rhs = (_arrays(self.operand_shape(comp, o)) for o in instr.operands[:2])
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

    def fusion_bytes(self, comp: str, instr: _Instr, callee: str) -> float:
        """What a fusion reads and writes: sliced parameters read their slices, an in-place update writes its
        update."""
        body = self.computations[callee]
        params = {i.name: int(i.operands[0]) for i in body if i.op == "parameter"}
        users: dict[str, list[_Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)

        def through_bitcasts(name: str) -> list[tuple[_Instr, str]]:
            """(user, the name it reads): the non-bitcast users of `name` and of its bitcasts."""
            out = []
            for user in users.get(name, []):
                out += through_bitcasts(user.name) if user.op == "bitcast" else [(user, name)]
            return out

        by_name = {i.name: i for i in body}
        root = by_name.get(self.roots.get(callee, ""))
        in_place, written = None, shape_bytes(instr.shape)
        node = root
        while node is not None and node.op == "bitcast":
            node = by_name.get(node.operands[0])
        if node is not None and node.op == "dynamic-update-slice":
            base = node.operands[0]
            while base not in params:
                prev = by_name.get(base)
                if prev is None or prev.op != "bitcast":
                    break
                base = prev.operands[0]
            if base in params:
                in_place = base
                written = shape_bytes(self.shapes[callee][node.operands[1]])
        read = 0.0
        for name, index in params.items():
            if name == in_place:
                continue
            consumers = through_bitcasts(name)
            if consumers and all(c.op in _SLICES and c.operands[0] == via for c, via in consumers):
                read += sum(shape_bytes(c.shape) for c, _ in consumers)
            elif index < len(instr.operands):
                read += shape_bytes(self.operand_shape(comp, instr.operands[index]))
        return read + written

    def instr_cost(self, comp: str, instr: _Instr, fused: bool) -> _Cost:
        cost = _Cost()
        op = instr.op
        if op == "while":
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
            return cost
        if op == "conditional":
            branches = (_callees(instr.attrs, "branch_computations") or
                        _callees(instr.attrs, "true_computation") + _callees(instr.attrs, "false_computation"))
            costs = [self.cost(b, fused) for b in branches]
            if costs:
                cost.add(max(costs, key=lambda c: (c.flops, c.bytes)))
            return cost
        if op == "fusion":
            for callee in _callees(instr.attrs, "calls"):
                inner = self.cost(callee, True)
                cost.add(inner)
                if not fused:
                    cost.bytes += self.fusion_bytes(comp, instr, callee)
            return cost
        if op in ("call", "async-start") or (op not in COLLECTIVES and _attr(instr.attrs, "calls")):
            for callee in _callees(instr.attrs, "to_apply") + _callees(instr.attrs, "calls"):
                cost.add(self.cost(callee, fused))
            return cost
        if op == "custom-call":
            cost.add(self.custom_call(comp, instr))
        elif op in ("dot", "convolution"):
            cost.matmul = self.matmul_flops(comp, instr)
            cost.flops = cost.matmul
        elif op in ELEMENTWISE:
            cost.flops = float(_elements(instr.shape))
        elif op in TRANSCENDENTAL:
            cost.trans = float(_elements(instr.shape))
        elif op in ("reduce", "reduce-window", "scatter", "select-and-scatter"):
            cost.flops = float(_elements(self.operand_shape(comp, instr.operands[0]))) if instr.operands else 0.0
        if op in COLLECTIVES:
            moved = shape_bytes(instr.shape)
            if op == "reduce-scatter" and instr.operands:
                moved = shape_bytes(self.operand_shape(comp, instr.operands[0]))
            cost.coll = moved
            return cost
        if fused or op in _FREE:
            return cost
        result = shape_bytes(instr.shape)
        if op in ("dynamic-slice", "slice"):
            cost.bytes = 2 * result
        elif op == "dynamic-update-slice":
            cost.bytes = 2 * shape_bytes(self.operand_shape(comp, instr.operands[1]))
        else:
            cost.bytes = result + sum(shape_bytes(self.operand_shape(comp, o)) for o in instr.operands)
        return cost


def hlo_cost(text: str) -> HloCost:
    """The per-device cost of an optimized HLO module (`compiled.as_text()`), loops counted by trip count."""
    module = _Module(text)
    total = module.cost(module.entry, False)
    return HloCost(flops=total.flops, matmul_flops=total.matmul, transcendentals=total.trans,
                   bytes_accessed=total.bytes, collective_bytes=total.coll,
                   unknown_trip_counts=tuple(dict.fromkeys(total.unknown)),
                   uncounted_custom_calls=tuple(dict.fromkeys(total.uncounted)))
