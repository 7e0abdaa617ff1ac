"""Where the bytes go: one train step's per-device memory at its peak, by named class.

run.py gives each step's four XLA totals (argument, output, temp, alias: `breakdown.json`); this script names what
is inside them. The step is compiled compile-only exactly as run.py compiles it (same builder, mesh, setting and
cheap CPU code generation), with XLA's dumps switched on; from the optimised module it reads
  - the arguments: every entry parameter's buffer, named by its pytree path (jax puts it in the op_name);
  - the temporaries: the buffer assignment's preallocated temp block and every value's live range; the peak is
    the instruction at which the values live at once cover the most bytes (values sharing a buffer counted
    once); each value live there is named by its shape, its HLO instruction, the jax op_name (named scopes of
    the model: "kl_probe", "realised_kl") and the innermost Python frame that emitted it;
  - the outputs that do not reuse a donated input buffer (output − alias).
The classes add up to XLA's own total (argument + output + temp − alias), checked per cell; bytes of the temp
block not covered by live values at the peak are reported as "packing slack".

  python experiments/memory/breakdown.py            # 7B@4 and 27B@4, adamw_targets vs LoGRA+KL, ~1 min
  python experiments/memory/breakdown.py --models Qwen2.5-Math-1.5B --optimizers logra_sketch_native --show 30

Writes `breakdown_classes.json` ({cell: {optimizer: {class: bytes}}}), `breakdown_classes.png` (stacked bars) and
prints the table (GiB per device) with, per cell, the largest buffers live at the peak (`--show`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import dataclasses
import glob
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from logra_jax.models.config import ModelConfig
from logra_jax.models.decoder import abstract_model
from logra_jax.parallel import sharding as shd
from logra_jax.planner.memory_analysis import rl_step_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: experiments.contenders
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # the memory table's setting: models, probes per device, sequence, rank

from experiments.contenders import paper_numerics

GIB = 2.0 ** 30
CELLS = (("Qwen2.5-Math-7B", 4), ("Dense-27B", 4))
OPTIMIZERS = ("adamw_targets", "logra_sketch_native_kl")

# Class names, in the order of the table and of the stacked bars (bottom first).
WEIGHTS = "weights (fp32 shard)"
OPT_STATE = "optimizer moments"
ROW_MOMENTS = "row moments"
PROBES = "sketch probes (zero receivers)"
BATCH = "batch and small arguments"
GATHERED = "gathered weight copies (FSDP)"
WEIGHT_COPIES = "weight-shard copies (cast / layout)"
GRADIENTS = "dense gradients"
SKETCHES = "sketches S and factors D"
SAVED = "saved activations (across the layer scan)"
LOGITS = "logits / log-prob chunks"
ATTENTION = "attention temporaries"
MLP = "MLP temporaries"
LAYER = "other layer temporaries"
PROJECTIONS = "projections A"
CPU_UPCAST = "XLA:CPU f32 copies of bf16 values"
OUTPUTS = "outputs not aliased"
OTHER = "other"
SLACK = "packing slack"
CLASSES = (WEIGHTS, OPT_STATE, ROW_MOMENTS, PROBES, BATCH, GATHERED, WEIGHT_COPIES, GRADIENTS, SKETCHES, SAVED,
           LOGITS, ATTENTION, MLP, LAYER, PROJECTIONS, CPU_UPCAST, OUTPUTS, OTHER, SLACK)
PHASES = ("probe JVP", "realised KL", "train step")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction of the optimised module: result dtype and dims, opcode, jax op_name, Python frame."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    opcode: str
    op_name: str
    frame: tuple[str, str]  # (file name, function) of the innermost user frame, ("", "") when unknown
    operands: tuple[str, ...]
    upcast: bool  # an f32 value the compiler made from a bf16 one (XLA:CPU computes bf16 in f32)
    elements: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (dtype, dims) of each array in the result
    from_weight: bool = False  # made from a parameter of the step by copies, casts, layout changes or gathers

    def element(self, index: str) -> Instruction:
        """The instruction as seen through one top-level tuple index ("{6}" of a loop carry), "{}" for itself."""
        i = index.strip("{}").split(",")[0]
        if not i or len(self.elements) <= int(i):
            return self
        dtype, dims = self.elements[int(i)]
        return dataclasses.replace(self, dtype=dtype, dims=dims)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A temp buffer live at the peak: its size and the instruction that defines it."""

    size: int
    instruction: Instruction


@dataclasses.dataclass
class Dump:
    temp_size: int
    temp_values: list[tuple[str, int, int]]  # (value name, size, offset) in the preallocated temp block
    live: dict[str, tuple[int, int]]  # value name -> (first, last) position in the flattened schedule
    instructions: dict[str, Instruction]
    parameters: dict[int, tuple[int, str]]  # entry parameter number -> (bytes, op_name: its pytree path)


_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_PARAMETER = re.compile(r"parameter\((\d+)\)")


def _one(dump_dir: str, suffix: str) -> str:
    paths = sorted(glob.glob(os.path.join(dump_dir, f"*{suffix}")))
    if not paths:
        raise FileNotFoundError(f"no *{suffix} in {dump_dir}: was the step compiled with xla_dump_to?")
    return Path(max(paths, key=os.path.getsize)).read_text()  # the step's module, not a helper's


def _frames(hlo: str) -> dict[int, tuple[str, str]]:
    """stack_frame_id -> (file name, function) of the frame's own location."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        m = re.match(r"^(\d+) (.*)$", line) if section else None
        if m is None:
            section = None if line.strip() else section
            continue
        tables[section][int(m.group(1))] = m.group(2)
    files = {i: s.strip('"').rsplit("/", 1)[-1] for i, s in tables["FileNames"].items()}
    functions = {i: s.strip('"') for i, s in tables["FunctionNames"].items()}
    locations = {}
    for i, s in tables["FileLocations"].items():
        fields = dict(re.findall(r"(\w+)=(\d+)", s))
        locations[i] = (files[int(fields["file_name_id"])], functions[int(fields["function_name_id"])])
    return {i: locations[int(dict(re.findall(r"(\w+)=(\d+)", s))["file_location_id"])]
            for i, s in tables["StackFrames"].items()}


def _instructions(hlo: str) -> dict[str, Instruction]:
    frames = _frames(hlo)
    parsed: dict[str, tuple] = {}
    computations: dict[str, list[str]] = {}  # fused computation name -> its instruction lines
    current: list[str] | None = None
    for line in hlo.splitlines():
        if line.startswith("%") and line.rstrip().endswith("{"):
            current = computations.setdefault(line.split(" ", 1)[0][1:], [])
            continue
        if current is not None:
            current.append(line)
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, result, opcode, rest = m.groups()
        elements = tuple((t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(result))
        op_name = _OP_NAME.search(rest)
        frame = _FRAME.search(rest)
        calls = re.search(r"calls=%(\S+?),", rest)
        operands = tuple(re.findall(r"%([\w.\-]+)", rest.split("), ", 1)[0]))
        where = frames.get(int(frame.group(1)), ("", "")) if frame else ("", "")
        parsed[name] = (elements, opcode, op_name.group(1) if op_name else "", where, operands,
                        calls.group(1) if calls else None)
    out = {}
    for name, (elements, opcode, op_name, frame, operands, calls) in parsed.items():
        dtype, dims = elements[0] if len(elements) == 1 else ("tuple", ())
        # Compiler-made f32 copies of bf16 values carry no jax op_name: a bare convert bf16 -> f32, or a fusion
        # whose body only converts (XLA:CPU has no bf16 arithmetic and upcasts bf16 dots' operands).
        body = computations.get(calls, []) if calls else []
        converts_only = body and all(re.search(r"= \S+ (parameter|convert|copy|bitcast|transpose)\(", ln)
                                     for ln in body if " = " in ln)
        upcast = dtype == "f32" and not op_name and (
            (opcode == "convert" and operands and parsed.get(operands[0], ((("",),),))[0][0][0] == "bf16")
            or (opcode == "fusion" and converts_only and any("bf16[" in ln for ln in body)))
        out[name] = Instruction(name, dtype, dims, opcode, op_name, frame, operands, bool(upcast), elements)
    # Fusions and copies the compiler made carry no op_name: they are named after the first operand that has one.
    for name, inst in out.items():
        seen, todo = set(), list(inst.operands)
        while not inst.op_name and todo and len(seen) < 8:
            source = out.get(todo.pop(0))
            if source is None or source.name in seen:
                continue
            seen.add(source.name)
            if source.op_name:
                out[name] = inst = dataclasses.replace(inst, op_name=source.op_name,
                                                       frame=inst.frame if inst.frame[0] else source.frame)
            todo.extend(source.operands)
    return out


def read_dump(dump_dir: str) -> Dump:
    """Parse the optimised step module's buffer assignment, live ranges and HLO from an XLA dump folder."""
    assignment = _one(dump_dir, "after_optimizations-buffer-assignment.txt")
    live_text = _one(dump_dir, "after_optimizations-live-range.txt")
    hlo = _one(dump_dir, "after_optimizations.txt")
    instructions = _instructions(hlo)
    param_names = {}
    for line in hlo.split("\nENTRY ", 1)[1].splitlines():
        m = _INSTRUCTION.match(line)
        p = _PARAMETER.search(line) if m and m.group(3) == "parameter" else None
        if p:
            param_names[int(p.group(1))] = instructions[m.group(1)].op_name
    temp_size, values, parameters, in_temp = 0, [], {}, False
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            size, kind = int(m.group(1)), m.group(2)
            in_temp = "preallocated-temp" in kind
            temp_size = size if in_temp else temp_size
            p = re.match(r"parameter (\d+),", kind)
            if p:
                parameters[int(p.group(1))] = (size, param_names.get(int(p.group(1)), ""))
            continue
        v = _VALUE.match(line) if in_temp else None
        if v:
            values.append((v.group(1) + (v.group(2) or "{}"), int(v.group(3)), int(v.group(4))))
    live = {}
    section = live_text.split("BufferLiveRange:", 1)[1].split("Live ranges at", 1)[0]
    for line in section.split("\n"):
        if ":" in line:
            name, span = line.strip().rsplit(":", 1)
            first, last = span.split("-")
            live[name] = (int(first), int(last))
    # Values derived from an entry parameter through data movement only (copies, converts, transposes, gathers).
    entry = {n for n, i in instructions.items() if i.opcode == "parameter" and i.op_name.startswith("state.")}
    moves = ("copy", "convert", "bitcast", "transpose", "fusion", "all-gather", "reshape")
    for name, inst in instructions.items():
        seen, todo, found = 0, list(inst.operands[:1]), False
        while todo and seen < 6 and not found:
            source = instructions.get(todo.pop(0))
            seen += 1
            if source is not None:
                found = source.name in entry
                todo.extend(source.operands[:1] if source.opcode in moves else ())
        if found and inst.opcode in moves:
            instructions[name] = dataclasses.replace(inst, from_weight=True)
    return Dump(temp_size, values, live, instructions, parameters)


def peak_buffers(dump: Dump) -> tuple[int, list[Buffer]]:
    """(bytes covered, buffers) at the schedule position where the live temp values cover the most bytes.
    Values that share a buffer (loop carries, bitcasts, in-place updates) count once, named by the first."""
    events: dict[int, list[tuple[int, tuple[int, int]]]] = collections.defaultdict(list)
    for name, size, offset in dump.temp_values:
        if name in dump.live:
            first, last = dump.live[name]
            events[first].append((1, (offset, size)))
            events[last + 1].append((-1, (offset, size)))
    count: collections.Counter = collections.Counter()
    covered, best, at = 0, -1, 0
    for t in sorted(events):
        for step, key in events[t]:
            if step == 1:
                covered += key[1] if count[key] == 0 else 0
                count[key] += 1
            else:
                count[key] -= 1
                covered -= key[1] if count[key] == 0 else 0
        if covered > best:
            best, at = covered, t
    by_key: dict[tuple[int, int], list[str]] = {}
    for name, size, offset in dump.temp_values:
        if name in dump.live and dump.live[name][0] <= at <= dump.live[name][1]:
            by_key.setdefault((offset, size), []).append(name)
    buffers = []
    for (_, size), names in by_key.items():
        # Prefer the defining instruction over loop parameters, tuples and get-tuple-elements that alias it.
        names.sort(key=lambda n: (any(s in n for s in ("param", "tuple", "while")), n))
        base, _, index = names[0].partition("{")
        inst = dump.instructions.get(base)
        if inst is None:
            inst = Instruction(names[0], "", (), "", "", ("", ""), (), False)
        buffers.append(Buffer(size, inst.element("{" + index)))
    return max(best, 0), sorted(buffers, key=lambda b: -b.size)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The dims that name a buffer: weights (whole per layer, and per-device shards), vocabulary, layers, rank."""

    layer_weights: frozenset  # per-layer whole weights and their transposes (sorted dims)
    shards: frozenset  # per-device shards of each parameter (sorted dims), stacked and per layer
    sketches: frozenset  # [L, d(/n), r] sketch shapes (sorted dims)
    vocab: frozenset  # V and its shards
    layers: int
    intermediate: frozenset
    heads: frozenset


def model_shapes(config: ModelConfig, devices: int, rank: int) -> Shapes:
    params = nnx.state(abstract_model(config), nnx.Param)
    layer_weights, shards, sketches = set(), set(), set()
    for leaf in jax.tree.leaves(params):
        shape = tuple(leaf.shape)
        per_layer = shape[1:] if len(shape) == 3 else shape
        if len(per_layer) == 2:
            layer_weights.add(tuple(sorted(per_layer)))
        for i, n in enumerate(shape):
            if n % devices == 0 and n > 1:
                shard = (*shape[:i], n // devices, *shape[i + 1:])
                shards.add(tuple(sorted(shard)))
                if len(shard) == 3:
                    shards.add(tuple(sorted(shard[1:])))
        if len(shape) == 3:
            for d in (shape[2], shape[2] // devices):
                sketches.add(tuple(sorted((shape[0], d, rank))))
    vocab = {config.vocab_size, config.vocab_size // devices}
    return Shapes(frozenset(layer_weights), frozenset(shards), frozenset(sketches), frozenset(vocab),
                  config.num_layers, frozenset({config.intermediate_size, config.intermediate_size // devices}),
                  frozenset({config.num_heads, config.num_kv_heads, config.head_dim}))


def classify_argument(op_name: str) -> str:
    """The class of an entry parameter from its pytree path."""
    if op_name.startswith("state.params"):
        return WEIGHTS
    if op_name.startswith("state.opt_state"):
        return ROW_MOMENTS if "row_moment" in op_name else OPT_STATE
    if "sketch_probe" in op_name:
        return PROBES
    return BATCH


def phase(inst: Instruction) -> str:
    """Which part of the step made a buffer: the predicted-KL probe's JVP, the realised KL, or the rest."""
    if "kl_probe" in inst.op_name or (inst.frame[0] == "kl_probe.py" and "realised" not in inst.frame[1]):
        return PHASES[0]
    if "realised_kl" in inst.op_name or inst.frame[1].startswith("realised_kl"):
        return PHASES[1]
    return PHASES[2]


def classify_temp(inst: Instruction, shapes: Shapes) -> str:
    """The class of a temp buffer from its dims, the instruction that defines it and where jax emitted it."""
    dims = tuple(d for d in inst.dims if d != 1)
    key = tuple(sorted(dims))
    file, function = inst.frame
    # weights are [in, out] or layer-stacked [L, in, out]; [B, T, D] activations can share a weight's two sizes
    weight_like = len(inst.dims) == 2 or (len(inst.dims) == 3 and shapes.layers in inst.dims)
    if not weight_like:
        key = ()
    if key in shapes.layer_weights:
        return GATHERED  # a whole layer's weight on one device (after the all-gather; f32 if XLA:CPU upcast it)
    if inst.upcast:
        return CPU_UPCAST
    if key in shapes.sketches:
        return SKETCHES
    if key in shapes.shards:
        # a per-device weight shard: a copy (cast, transposed) when made from a weight by data movement alone,
        # else in float32 a dense gradient (or its accumulator: zeros broadcast, loop carries, their copies)
        return WEIGHT_COPIES if inst.from_weight or inst.dtype != "f32" else GRADIENTS
    if file == "projection.py":
        return PROJECTIONS
    if any(d in shapes.vocab for d in dims):
        return LOGITS
    if dims and dims[0] == shapes.layers and len(dims) >= 3:
        return SAVED
    if "/attention/" in inst.op_name or (file == "layers.py" and ("attention" in function or "rope" in function)):
        return ATTENTION
    if "/mlp/" in inst.op_name:
        return MLP
    if len(dims) >= 2 and math.prod(dims) >= 1 << 16:
        return LAYER
    return OTHER


def breakdown(dump: Dump, memory: dict[str, int], shapes: Shapes) -> tuple[dict[str, int], list[tuple]]:
    """{class: bytes} adding up to memory['total'], and the largest buffers live at the peak (for the report)."""
    classes: collections.Counter = collections.Counter()
    for size, op_name in dump.parameters.values():
        classes[classify_argument(op_name)] += size
    if sum(classes.values()) != memory["argument"]:
        raise ValueError(f"entry parameters hold {sum(classes.values())} bytes, XLA counts {memory['argument']}")
    covered, buffers = peak_buffers(dump)
    if dump.temp_size != memory["temp"]:
        raise ValueError(f"temp block of {dump.temp_size} bytes, XLA counts {memory['temp']}")
    rows = []
    for b in buffers:
        cls = classify_temp(b.instruction, shapes)
        ph = phase(b.instruction)
        classes[f"{ph}: {cls}" if ph != PHASES[2] else cls] += b.size
        rows.append((b.size, ph, cls, b.instruction))
    classes[SLACK] += memory["temp"] - covered
    classes[OUTPUTS] += memory["output"] - memory["alias"]
    if sum(classes.values()) != memory["total"]:
        raise ValueError(f"classes add up to {sum(classes.values())}, XLA's total is {memory['total']}")
    return dict(classes), rows


def measure(model: str, devices: int, optimizer: str, show: int = 0, target: str = "cpu") -> dict[str, int]:
    """One cell: compile as run.py does, with dumps, and name every byte (`target`: a compile-only chip of
    `logra_jax.planner.aot`, e.g. "h100" under .venv-cuda; default the fake CPU devices)."""
    start = time.perf_counter()
    if target == "cpu":
        mesh = shd.make_mesh(shd.MeshConfig(fsdp=-1), jax.devices()[:devices])
    else:
        from logra_jax.planner import aot

        mesh = aot.mesh(aot.target_for(target, devices), shd.MeshConfig(fsdp=-1))
    section = run.OPTIMIZER_SECTIONS[optimizer]
    if section.kl_control:
        section = dataclasses.replace(section, probe_responses=run.PROBES_PER_DEVICE * devices)
    config = paper_numerics(run.MODELS[model], run.SEQ_LEN)
    with tempfile.TemporaryDirectory(prefix="breakdown-") as dump_dir:
        options = {**shd.FAST_CPU_COMPILE, "xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
        memory = rl_step_memory(config, section, mesh, seq_len=run.SEQ_LEN, prompt_len=run.PROMPT_LEN,
                                logprob_chunk=run.LOGPROB_CHUNK, compiler_options=options)
        dump = read_dump(dump_dir)
    classes, rows = breakdown(dump, memory, model_shapes(config, devices, run.RANK))
    print(f"{model}@{devices}dev {optimizer} ({target}): {memory['total'] / GIB:.2f} GiB per device "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    for size, ph, cls, inst in rows[:show]:
        where = f"{inst.frame[0]}:{inst.frame[1]}" if inst.frame[0] else inst.op_name[-60:]
        print(f"  {size / 2**20:9.1f} MiB  {inst.dtype}{list(inst.dims)}  {ph} / {cls}  "
              f"[{inst.opcode} {inst.name}; {where}]")
    return classes


def table(results: dict[str, dict[str, dict[str, int]]]) -> str:
    """Markdown: one row per class, one column per (cell, optimizer), GiB per device."""
    columns = [(cell, opt) for cell, row in results.items() for opt in row]
    names = [c for c in ordered_classes(results)]
    lines = ["| class | " + " | ".join(f"{cell} {opt}" for cell, opt in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    small = []
    for name in names:
        cells = [results[c][o].get(name, 0) / GIB for c, o in columns]
        if max(cells) < 0.005:
            small.append(name)
            continue
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" if x >= 0.005 else "–" for x in cells) + " |")
    totals = [sum(results[c][o].values()) / GIB for c, o in columns]
    lines.append("| **total** | " + " | ".join(f"**{x:.2f}**" for x in totals) + " |")
    if small:
        lines.append(f"\nUnder 0.005 GiB in every column: {', '.join(small)}.")
    return "\n".join(lines)


def ordered_classes(results: dict[str, dict[str, dict[str, int]]]) -> list[str]:
    present = {name for row in results.values() for classes in row.values() for name in classes}

    def rank(name: str) -> tuple[int, int]:
        ph, _, cls = name.rpartition(": ")
        return (CLASSES.index(cls) if cls in CLASSES else len(CLASSES), PHASES.index(ph) if ph in PHASES else 2)

    return sorted(present, key=rank)


def plot(results: dict[str, dict[str, dict[str, int]]], path: Path, compiler: str = "XLA:CPU") -> None:
    """Stacked bars, one panel per cell and one bar per optimizer, one segment per class (a class's colour;
    hatched where the KL probe's JVP or the realised KL made it), with the issue's goals as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ordered_classes(results)
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results) + 4, 6), squeeze=False)
    handles = {}
    for ax, (cell, row) in zip(axes[0], results.items()):
        bottoms = [0.0] * len(row)
        for name in names:
            ph, _, cls = name.rpartition(": ")
            ys = [classes.get(name, 0) / GIB for classes in row.values()]
            if max(ys) < 0.01:
                continue
            bars = ax.bar(range(len(row)), ys, 0.6, bottom=bottoms, color=cmap(CLASSES.index(cls) % 20),
                          hatch="//" if ph else None, edgecolor="white", linewidth=0.3)
            handles.setdefault(name, bars)
            bottoms = [b + y for b, y in zip(bottoms, ys)]
        for x, classes in enumerate(row.values()):
            total = sum(classes.values()) / GIB
            ax.text(x, total * 1.01, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
        if "adamw_targets" in row:
            goal = 0.30 * sum(row["adamw_targets"].values()) / GIB
            ax.axhline(goal, color="k", linestyle="--", linewidth=0.8)
            ax.text(len(row) - 0.6, goal, "0.30 × adamw_targets", ha="right", va="bottom", fontsize=7)
        ax.set_xticks(range(len(row)), [o.replace(" [", "\n[") for o in row], fontsize=7)
        ax.set_title(cell, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GiB per device at the step's peak (argument + temp + unaliased output)")
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.suptitle(f"Where the bytes go: one RL train step, {compiler} buffer assignment, FSDP", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=[m for m, _ in CELLS], choices=list(run.MODELS))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=list(run.OPTIMIZERS))
    parser.add_argument("--show", type=int, default=0, help="print the largest N buffers live at each peak")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--target", default="cpu",
                        help="a compile-only chip (logra_jax.planner.aot), e.g. h100 under .venv-cuda with "
                             "JAX_PLATFORMS=cpu")
    parser.add_argument("--baseline", metavar="JSON:LABEL",
                        help="also show the cells of an earlier run's breakdown_classes.json (e.g. an older "
                             "revision's), as '<optimizer> [LABEL]' beside this run's")
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, int]]] = {}
    for model in args.models:
        cell = f"{model}@{args.devices}dev"
        earlier, label = {}, ""
        if args.baseline:
            path, _, label = args.baseline.rpartition(":")
            earlier = json.loads(Path(path).read_text()).get(cell, {})
        for opt in args.optimizers:
            if opt in earlier:  # the earlier run's bar just before this run's
                results.setdefault(cell, {})[f"{opt} [{label}]"] = earlier[opt]
            results.setdefault(cell, {})[opt] = measure(model, args.devices, opt, args.show, args.target)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "breakdown_classes.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "breakdown_classes.png", "XLA:CPU" if args.target == "cpu" else args.target)
    print("\nGiB per device at the peak, by class:\n")
    print(table(results))


if __name__ == "__main__":
    main()
