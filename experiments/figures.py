"""The measured figures that experiments/REPORT.md, README.md and the docs pages quote, each tied to its results file.

A figure is registered as a `Quote`: a passage of one document as it reads there, with every figure in it written
as a format field (`"dense AdamW {:.2f} GiB"`), and the values the fields take, computed here from the committed
results file named as its source. `tests/docs/test_quoted_figures.py` checks that

- each quote, rendered from today's files, appears in its document (whitespace and line breaks aside), so a rerun
  that changes a figure fails until the text says the new one, naming the quote and its source;
- every number in the sections of `CHECKED` (all of REPORT.md, its "In brief" list included) is a field of a
  registered quote or matches `SETTINGS`: counts of seeds, steps and devices, ranks, step sizes, dates, meshes —
  what a run was given, not what it measured.

To register a figure: find the function below that reads its results file (or add one and list it in `quotes()`),
and add `q(DOCS, "the passage with {:.2f} fields", value, ...)`. The passage needs just enough words around the
field to be unique and to say what the figure is. Fields use Python's format specs; a leading minus renders as
"−" and an exponent without padding ("5.3e-6"), as the documents write them. The paper's figures come from
docs/method.md (`_paper`), which quotes the paper's digests. Figures quoted elsewhere (README, docs/method.md, the
docs pages) are checked the same way; only the sections of `CHECKED` must have every number registered. The test
suite's timings (docs/testing.md) and the `make venv-*` timings are measurements without a results file: not
registered.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import statistics
import string
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from logra_jax.planner import aot

ROOT = Path(__file__).resolve().parents[1]
GIB = 2.0**30

README = ("README.md",)
REPORT = ("experiments/REPORT.md",)
METHOD = ("docs/method.md",)
ROUTES = ("docs/routes.md",)
RUNNING = ("docs/running.md",)
VLLM = ("docs/vllm.md",)
MEMORY = ("experiments/memory/README.md",)
ROLLOUT = ("experiments/rollout/README.md",)

# Document → the heading whose section must have every number registered (None: the whole document).
CHECKED: dict[str, str | None] = {"experiments/REPORT.md": None}

# Numbers that are settings, not measurements (regexes over whitespace-normalised text; what they match is exempt).
SETTINGS: tuple[str, ...] = (
    r"\d{4}-\d{2}-\d{2}",  # dates
    r"arXiv:\S+",
    r"issues? \d+",
    r"§\d",
    # step sizes given to a run: "update ratio ≥ 3e-4", "lr 3e-6", "ratio ~1e-2 (tiny) and ~1e-4"
    r"(?:update ratio|ratio|lr) (?:≥ |~)?\d(?:\.\d)?e-\d+(?: \(\w+\) and ~\d+e-\d+)?",
    # meshes and machines: "4 × H100", "8×H100", "2 processes × 4 CPU devices", "fsdp 4 × tensor 2", "2-core"
    r"\b\d+ ?× ?(?:TPU |H100|v5e|v5p|v6e)",
    r"(?:fsdp|tensor) \d+",
    r"\d+ slots",  # the rollout engine's slots (config.rollout.slots)
    r"\d+ (?:H100s|TPU v5e|processes|process|CPU devices|fake devices|devices|prompts at a time)(?: × \d+)?",
    r"\d+-(?:device|token|step|core|wide)\b",
    r"\((?:16|32) GiB\)|(?:fit|of) (?:16|80) GiB",  # a chip's memory
    r"\b(?:v4|v5e|v5p|v6e|h100|h200|a100):\d+(?:x\d+)*: \d+ × \d+ GiB",  # a target: its chips and their memory
    # counts a run was given
    r"\d+(?:–\d+)? (?:seeds?|RL steps|GRPO steps|steps|updates|sequences per device|values|tokens)\b",
    r"seed \d+",
    r"\b(?:r|rank) (?:= )?\d+(?: / \d+)*(?: → \d+)?",  # ranks
    r"momentum \d\.\d",  # β₁
    r"budgets? ×\d+(?:\.\d+)?(?:–×\d+)?|×\d+ apart",  # the KL budget's scale, the sweep's grid
    # r/k, from the models' shapes
    r"\d+–\d+% of a gradient's row space \(the paper's 7B: \d+\.\d+–\d+%\)",
)


@dataclasses.dataclass(frozen=True)
class Quote:
    """`text` with its format fields filled by `values` must appear in `doc`; `source` names the results file(s)."""

    doc: str
    text: str
    values: tuple[float, ...]
    source: str

    def render(self) -> str:
        return "".join(piece for piece, _ in self.pieces())

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """The rendered text in pieces, each with whether it is a figure (a filled field) or the text around it."""
        fields = iter(self.values)
        for literal, field, spec, _ in string.Formatter().parse(" ".join(self.text.split())):
            if literal:
                yield literal, False
            if field is not None:
                yield _format(next(fields), spec or ""), True


def _format(value: float, spec: str) -> str:
    text = format(value, spec)
    if spec.endswith("e"):
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return "−" + text[1:] if text.startswith("-") else text


def _quoter(source: str) -> Callable[..., list[Quote]]:
    """q(docs, text, *values): the quotes of `text` in each of `docs`, its fields filled from `source`."""
    def q(docs: Sequence[str], text: str, *values: float) -> list[Quote]:
        fields = sum(field is not None for _, field, _, _ in string.Formatter().parse(text))
        if fields != len(values):
            raise ValueError(f"{text!r} has {fields} fields for {len(values)} values")
        return [Quote(doc, text, tuple(values), source) for doc in docs]
    return q


@functools.cache
def _json(path: str) -> Any:
    return json.loads((ROOT / path).read_text(encoding="utf-8"))


def _bound(measured: float, claimed: float) -> float:
    """A claimed upper bound ("no seed drops > 0.10"): the bound while the measurement keeps it, else the
    measurement, so that the text fails once the claim does."""
    return claimed if measured <= claimed else measured


def _all(count: int, of: int) -> float:
    """A claim that all `of` things hold: `of` if `count` is all of them, else NaN (renders as no document does)."""
    return of if count == of else math.nan


@functools.cache
def _paper(literal: str, section: str = "§7") -> float:
    """A figure of the paper as docs/method.md `section` writes it ("17.29 GiB", "1,100"): its value, after checking
    that the section holds that text."""
    method = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    start = method.index(f"## {section} ")
    body = method[start:method.index("\n## ", start + 1)]
    if literal not in body:
        raise ValueError(f"docs/method.md {section} does not quote the paper's {literal!r}")
    return float(re.match(r"[~+]?([\d,.]+)", literal).group(1).replace(",", ""))


# --- memory: compile-only bytes per device ---------------------------------------------------------------------

def _cpu_gib(path: str, cell: str) -> dict[str, float]:
    return {opt: total / GIB for opt, total in _json(path)[cell].items()}


def _target(chip: str, cell: str, optimizer: str, implementation: str = "xla") -> dict[str, Any]:
    return _json(f"experiments/memory/targets/{chip}.json")["cells"][cell][optimizer][implementation]


def _target_gib(chip: str, cell: str, optimizer: str) -> float:
    """A cell's total bytes; for a step the TPU compiler refused, the bytes it said it needs."""
    c = _target(chip, cell, optimizer)
    return (c["total"] if c.get("total") is not None else c["required"]) / GIB


def _memory() -> Iterator[Quote]:
    q = _quoter("experiments/memory/results.json")
    m7 = _cpu_gib("experiments/memory/results.json", "Qwen2.5-Math-7B@4dev")
    m15 = _cpu_gib("experiments/memory/results.json", "Qwen2.5-Math-1.5B@4dev")
    m27 = _cpu_gib("experiments/memory/results.json", "Dense-27B@4dev")
    paper_7b = _paper("17.29 GiB") / _paper("31.82 GiB")
    yield from q(REPORT, "Qwen2.5-Math-7B — dense AdamW {:.2f} GiB, LoGRA sketch-native {:.2f} GiB ({:.0%}; the "
                         "paper: {:.1%}; {:.2f} GiB with the KL probe); 27B-class — AdamW {:.2f} GiB (does not fit "
                         "80 GiB), LoGRA {:.2f} GiB.", m7["adamw"], m7["logra_sketch_native"],
                 m7["logra_sketch_native"] / m7["adamw"], paper_7b, m7["logra_sketch_native_kl"], m27["adamw"],
                 m27["logra_sketch_native"])
    yield from q(REPORT, "AdamW {:.2f} GiB, LoGRA sketch-native **{:.2f} GiB (−{:.0%})**, LoGRA dense-gradient mode "
                         "{:.2f} GiB (−{:.0%})", m7["adamw"], m7["logra_sketch_native"],
                 1 - m7["logra_sketch_native"] / m7["adamw"], m7["logra_dense_grad"],
                 1 - m7["logra_dense_grad"] / m7["adamw"])
    yield from q(REPORT, "our AdamW baseline is within {:.1%} of the paper's", m7["adamw"] / _paper("31.82 GiB") - 1)
    yield from q(REPORT, "AdamW {:.2f} GiB, sketch-native {:.2f} GiB (−{:.0%}), dense-gradient {:.2f} GiB (−{:.0%});",
                 m15["adamw"], m15["logra_sketch_native"], 1 - m15["logra_sketch_native"] / m15["adamw"],
                 m15["logra_dense_grad"], 1 - m15["logra_dense_grad"] / m15["adamw"])
    yield from q(REPORT, "AdamW {:.2f} GiB (does not fit 80 GiB), sketch-native {:.2f} GiB, dense-gradient {:.2f} GiB;",
                 m27["adamw"], m27["logra_sketch_native"], m27["logra_dense_grad"])
    yield from q(REPORT, "(7B: dense-gradient-mode LoGRA {:.2f} GiB vs sketch-native {:.2f} GiB)",
                 m7["logra_dense_grad"], m7["logra_sketch_native"])
    yield from q(METHOD, "the largest memory saving: {:.2f} vs {:.2f} GiB per device at 7B",
                 m7["logra_sketch_native"], m7["logra_dense_grad"])

    q = _quoter("experiments/memory/tensor_parallel/results.json")
    tp7 = _cpu_gib("experiments/memory/tensor_parallel/results.json", "Qwen2.5-Math-7B@8dev_tp2")
    tp27 = _cpu_gib("experiments/memory/tensor_parallel/results.json", "Dense-27B@8dev_tp2")
    yield from q(REPORT, "(fsdp 4 × tensor 2): {:.2f} vs {:.2f} GiB ({:.0%}) at 7B", tp7["logra_sketch_native"],
                 tp7["adamw"], tp7["logra_sketch_native"] / tp7["adamw"])
    yield from q(REPORT, "(fsdp 4 × tensor 2): {:.2f} vs {:.2f} GiB;", tp27["adamw"], tp27["logra_sketch_native"])


def _memory_targets() -> Iterator[Quote]:
    q = _quoter("experiments/memory/targets/{v5e,v6e,h100}.json")
    c7, c15, c27 = "Qwen2.5-Math-7B@4dev", "Qwen2.5-Math-1.5B@4dev", "Dense-27B@4dev"
    bf16_h100 = _target_gib("h100", c7, "logra_sketch_native_kl_bf16")
    bf16_ratio = bf16_h100 / _target_gib("h100", c7, "adamw_targets")
    bf16_v5e = _target_gib("v5e", c7, "logra_sketch_native_kl_bf16")
    bf16_27b = _target_gib("h100", c27, "logra_sketch_native_kl_bf16")
    yield from q(REPORT, "LoGRA+KL {:.2f} GiB at 7B on 4 H100s (XLA:GPU; {:.2f}× AdamW on the same targets), "
                         "{:.2f} GiB on 4 TPU v5e (TPU compiler), {:.2f} GiB at 27B-class on 4 H100s;",
                 bf16_h100, bf16_ratio, bf16_v5e, bf16_27b)
    yield from q(REPORT, "LoGRA+KL {:.2f} GiB on 4 × H100 ({:.2f}× AdamW-on-targets) and {:.2f} GiB on 4 × v5e;",
                 bf16_h100, bf16_ratio, bf16_v5e)
    yield from q(REPORT, "with bfloat16 weights LoGRA+KL is {:.2f} GiB per device on 4 × H100", bf16_27b)
    usable = _target("v5e", c7, "adamw")["available"] / GIB
    yield from q(REPORT, "refuses AdamW and AdamW-on-targets ({:.2f} / {:.2f} GiB needed, {:.2f} usable) and fits "
                         "LoGRA sketch-native at {:.2f} GiB ({:.2f} with its KL probe); 4 × v6e (32 GiB) refuses AdamW "
                         "too ({:.2f} GiB); XLA:GPU on 4 × H100: AdamW {:.2f}, AdamW-on-targets {:.2f}, LoGRA "
                         "sketch-native {:.2f} GiB.",
                 _target_gib("v5e", c7, "adamw"), _target_gib("v5e", c7, "adamw_targets"), usable,
                 _target_gib("v5e", c7, "logra_sketch_native"), _target_gib("v5e", c7, "logra_sketch_native_kl"),
                 _target_gib("v6e", c7, "adamw"), _target_gib("h100", c7, "adamw"),
                 _target_gib("h100", c7, "adamw_targets"), _target_gib("h100", c7, "logra_sketch_native"))
    yield from q(REPORT, "TPU compiler (4 × v5e): {:.2f} vs {:.2f} GiB; XLA:GPU (4 × H100): {:.2f} vs {:.2f} GiB",
                 _target_gib("v5e", c15, "adamw"), _target_gib("v5e", c15, "logra_sketch_native"),
                 _target_gib("h100", c15, "adamw"), _target_gib("h100", c15, "logra_sketch_native"))

    q = _quoter("experiments/memory/targets/{v5e,h100}.json, experiments/memory/results.json")
    m7 = _cpu_gib("experiments/memory/results.json", c7)
    m15 = _cpu_gib("experiments/memory/results.json", c15)
    yield from q(MEMORY, "TPU compiler plans more than XLA:CPU for every row (7B LoGRA {:.2f} vs {:.2f} GiB; 1.5B "
                         "AdamW {:.2f} vs {:.2f}, LoGRA {:.2f} vs {:.2f}, LoGRA + KL probe {:.2f} vs {:.2f})",
                 _target_gib("v5e", c7, "logra_sketch_native"), m7["logra_sketch_native"],
                 _target_gib("v5e", c15, "adamw"), m15["adamw"], _target_gib("v5e", c15, "logra_sketch_native"),
                 m15["logra_sketch_native"], _target_gib("v5e", c15, "logra_sketch_native_kl"),
                 m15["logra_sketch_native_kl"])
    yield from q(MEMORY, "(7B: AdamW {:.2f} vs {:.2f} GiB, LoGRA sketch-native {:.2f} vs {:.2f}): like for like "
                         "(AdamW on the same targets), LoGRA takes {:.0%} at 7B", _target_gib("h100", c7, "adamw"),
                 m7["adamw"],
                 _target_gib("h100", c7, "logra_sketch_native"), m7["logra_sketch_native"],
                 _target_gib("h100", c7, "logra_sketch_native") / _target_gib("h100", c7, "adamw_targets"))


def _bf16_learning() -> Iterator[Quote]:
    q = _quoter("experiments/memory/bf16_weights.json")
    runs = _sweep("experiments/memory/bf16_weights.json")
    bf16, f32 = runs["logra-layer-bf16"], runs["logra-layer"]
    yield from q(REPORT, "learning on the demo task unchanged ({:.3f} ± {:.3f} vs {:.3f} ± {:.3f} held-out, 3 seeds)",
                 bf16.after, bf16.std, f32.after, f32.std)
    yield from q(REPORT, "(held-out {:.3f} ± {:.3f} vs {:.3f} ± {:.3f} with float32 weights, 3 seeds)",
                 bf16.after, bf16.std, f32.after, f32.std)


def _if_level(diff: dict[str, Any], value: float) -> float:
    """`value` while a paired verdict (experiments.sweep.paired) is "level", NaN otherwise: for a text that says
    level, so that it fails once the verdict changes."""
    return value if diff["verdict"] == "level" else math.nan


def _bf16_smollm2() -> Iterator[Quote]:
    path = "experiments/memory/bf16_smollm2/results.json"
    q, runs, stats = _quoter(path), _sweep(path), _json(path)["updates"]
    bf16, f32 = runs["logra-layer-bf16"], runs["logra-layer-f32"]
    diff = stats["paired_bf16_minus_f32"]["accuracy_after"]
    below = _if_level(diff, statistics.median(s["share_below_half_spacing"] for s in stats["logra-layer-bf16"]))
    yield from q(REPORT, "and on SmolLM2-135M at its tuned per-layer ratio 5e-5, where {:.1%} of each step's "
                         "entries are below half a bfloat16 spacing: {:.3f} ± {:.3f} vs {:.3f} ± {:.3f} held-out after "
                         "20 RL steps, level (paired difference {:+.3f}, {:.0%} interval {:+.3f} … {:+.3f}, 3 seeds)",
                 below, bf16.after, bf16.std, f32.after, f32.std, diff["mean"], diff["level"], *diff["interval"])


def _roofline_s(chip: str, cell: str, optimizer: str) -> float:
    c = _target(chip, cell, optimizer)
    return aot.roofline(c["flops"], c["bytes_accessed"], c["collective_bytes"], c["target"]).seconds


def _step_cost() -> Iterator[Quote]:
    q = _quoter("experiments/memory/targets/{h100,v5p}.json")
    c7 = "Qwen2.5-Math-7B@4dev"
    flops = _target("h100", c7, "logra_sketch_native")["flops"] / _target("h100", c7, "adamw_targets")["flops"]
    t = {(chip, opt): _roofline_s(chip, c7, opt) for chip in ("h100", "v5p")
         for opt in ("adamw_targets", "logra_sketch_native", "logra_sketch_native_kl")}
    probe = {chip: t[chip, "logra_sketch_native_kl"] - t[chip, "logra_sketch_native"] for chip in ("h100", "v5p")}
    per_sequence = [(t[chip, "logra_sketch_native_kl"] / t[chip, "adamw_targets"]) for chip in ("h100", "v5p")]
    paper_sequences = 64  # experiments/memory/run.py's PAPER_SEQUENCES_PER_DEVICE (the paper's recipe)
    share = {chip: probe[chip] / (paper_sequences * t[chip, "logra_sketch_native"]) for chip in ("h100", "v5p")}
    if f"{per_sequence[0]:.1f}" != f"{per_sequence[1]:.1f}":
        per_sequence[0] = math.nan  # the text gives one figure for both chips
    yield from q(REPORT, "at 7B LoGRA sketch-native runs {:.2f}× AdamW-on-targets' flops", flops)
    yield from q(REPORT, "is {:.2f}× on 4 × H100, where the step is memory-bound, and {:.2f}× on 4 × TPU v5p,",
                 t["h100", "logra_sketch_native"] / t["h100", "adamw_targets"],
                 t["v5p", "logra_sketch_native"] / t["v5p", "adamw_targets"])
    yield from q(REPORT, "the KL probe costs {:.1f}× per training sequence and {:.0%} (H100) to {:.0%} (v5p) of a step "
                         "of the paper's 64 sequences per device", per_sequence[0], share["h100"], share["v5p"])
    c15 = "Qwen2.5-Math-1.5B@4dev"
    v5e = {opt: _roofline_s("v5e", c15, opt) for opt in ("adamw_targets", "logra_sketch_native",
                                                         "logra_sketch_native_kl")}
    yield from _quoter("experiments/memory/targets/v5e.json")(
        REPORT, "on 4 × TPU v5e at 1.5B, LoGRA is {:.2f}× AdamW-targets and the probe {:.0%} of such a step",
        v5e["logra_sketch_native"] / v5e["adamw_targets"],
        (v5e["logra_sketch_native_kl"] - v5e["logra_sketch_native"]) / (paper_sequences * v5e["logra_sketch_native"]))


def _whole_job() -> Iterator[Quote]:
    q = _quoter("experiments/memory/whole_job.json")
    plans = {(p["size"], p["target"], p["optimizer"]): p for p in _json("experiments/memory/whole_job.json")}

    def phase(plan: dict[str, Any], name: str) -> float:
        return next(p["total"] for p in plan["phases"] if p["name"] == name) / GIB

    def peak(plan: dict[str, Any]) -> float:
        return max(p["total"] for p in plan["phases"]) / GIB

    logra7, adamw7 = plans["7b", "v5e:2x4", "logra_kl"], plans["7b", "v5e:2x4", "adamw_targets"]
    logra27, adamw27 = plans["dense-27b", "h100:8", "logra_kl"], plans["dense-27b", "h100:8", "adamw_targets"]
    yield from q(REPORT, "LoGRA+KL fits, peak {:.2f} of 16 GiB (the policy sync: the cast and reshard into the rollout "
                         "engine's layout; rollout {:.2f} in 32 slots); AdamW-targets does not (train step refused at "
                         "{:.2f} GiB; rollout {:.2f}).",
                 peak(logra7), phase(logra7, "rollout"), phase(adamw7, "train step"), phase(adamw7, "rollout"))
    yield from q(REPORT, "LoGRA+KL fits, peak {:.2f} of 80 GiB (the rollout); AdamW-targets does not ({:.2f})",
                 peak(logra27), peak(adamw27))
    gemma = plans["27b", "h100:8", "logra_kl"]
    gemma_adamw = plans["27b", "h100:8", "adamw_targets"]
    yield from q(REPORT, "Gemma-3-27B on 8 × H100 (XLA:GPU): LoGRA+KL fits, peak {:.2f} of 80 GiB (the rollout), one "
                         "RL step {:.0f} s on paper; AdamW-targets fits too with this engine ({:.2f} GiB, the train "
                         "step)", peak(gemma), gemma["rl_step"]["seconds"], peak(gemma_adamw))
    yield from q(MEMORY, "**AdamW on LoGRA's targets fits here too**, at {:.2f} GiB (its train step; rollout {:.2f})",
                 peak(gemma_adamw), phase(gemma_adamw, "rollout"))
    yield from q(REPORT, "so there the saving is {:.2f}× the peak, not fit vs no fit", peak(gemma) / peak(gemma_adamw))
    yield from q(MEMORY, "LoGRA's peak is {:.2f}× AdamW-targets' here", peak(gemma) / peak(gemma_adamw))
    yield from q(MEMORY, "LoGRA's whole job fits at a peak of {:.2f} GiB (the rollout", peak(gemma))
    yield from q(MEMORY, "its peak is the policy sync, {:.2f} GiB", peak(logra7))
    yield from q(MEMORY, "train step {:.2f}, policy sync {:.2f} (24.97 before", phase(gemma, "train step"),
                 phase(gemma, "policy sync"))
    # the table, row by row as whole_job.py writes it from the same file
    table = _quoter("experiments/memory/whole_job.md")
    for row in (ROOT / "experiments/memory/whole_job.md").read_text().splitlines()[2:]:
        yield from table(MEMORY, row.replace("{", "{{").replace("}", "}}"))


def _fits() -> Iterator[Quote]:
    """The generated what-fits-where table (experiments/memory/fits.py), line by line, in every document it is in."""
    from experiments.memory import fits

    q = _quoter("experiments/memory/fits.json")
    docs = tuple(str(path.relative_to(ROOT)) for path in fits.BLOCK_FILES)
    rows = fits.load_rows()
    for template, values in [fits.placement_template(g) for g in fits.placements(rows)] + [fits.tally_template(rows)]:
        yield from q(docs, template, *values)
    # the H100 cells replanned with the per-layer GPU engine (the figures before it are from the cells' history)
    cell = lambda name: _json(f"experiments/memory/fits_cells/{name}.json")
    phase = lambda plan, name: next(p for p in plan["phases"] if p["name"] == name)
    seven, seven_adamw = cell("7b,1gpu@h100_1@logra_kl"), cell("7b,1gpu@h100_1@adamw")
    q = _quoter("experiments/memory/fits_cells/")
    yield from q(MEMORY, "rollout peak rose from 31.06 to {:.2f} GiB, and a rollout's decode time on paper fell from "
                         "348 s to {:.0f} s (the RL step from 487 s to {:.0f} s; AdamW's from 522 s to {:.0f} s)",
                 phase(seven, "rollout")["total"] / GIB, phase(seven, "rollout")["time"]["est_seconds"],
                 seven["rl_step"]["seconds"], seven_adamw["rl_step"]["seconds"])
    yield from q(MEMORY, "the policy sync fell from 38.62 to {:.2f} GiB (72B LoGRA+KL) and from 17.40 to {:.2f}",
                 phase(cell("72b@h100_8@logra_kl"), "policy sync")["total"] / GIB,
                 phase(cell("qwen3-32b@h100_8@logra_kl"), "policy sync")["total"] / GIB)


def _dropin() -> Iterator[Quote]:
    q = _quoter("experiments/dropin/results.json")
    rows = {(r["model"], r["devices"]): r for r in _json("experiments/dropin/results.json")["results"]
            if r["weights"] == "float32"}

    def total(model: str, devices: int, route: str) -> float:
        return rows[model, devices]["routes"][route]["total"] / GIB

    extra = [r["dense_extra"] / (r["sizes"]["targets_f32"] / r["devices"]) for r in rows.values()]
    s, b = "SmolLM2-135M", "Qwen2.5-Math-1.5B"
    yield from q(ROUTES, "that is {:.2f}–{:.2f}× the float32 size of all targets on top of the lean route: "
                         "SmolLM2-135M {:.2f} → {:.2f} GiB, Qwen2.5-Math-1.5B {:.1f} → {:.1f} GiB on one device "
                         "({:.2f} → {:.2f} GiB per device on 8); still below AdamW on the same targets "
                         "({:.2f} / {:.1f} GiB)",
                 min(extra), max(extra), total(s, 1, "lowrank_merge"), total(s, 1, "dense_updates"),
                 total(b, 1, "lowrank_merge"), total(b, 1, "dense_updates"), total(b, 8, "lowrank_merge"),
                 total(b, 8, "dense_updates"), total(s, 1, "adamw_targets"), total(b, 1, "adamw_targets"))


def _rollout_plans() -> Iterator[Quote]:
    q = _quoter("experiments/rollout/plans.json")
    cells = {c["cell"]: c for c in _json("experiments/rollout/plans.json")["cells"]}
    yield from q(RUNNING, "for the paper's 7B recipe on v5e:2x4 it is {:.2f}× the floor, and for Gemma-3-27B on "
                          "h100:8 {:.2f}×",
                 cells["7b@v5e:2x4"]["ratio_to_floor"], cells["27b@h100:8"]["ratio_to_floor"])
    yield from q(ROLLOUT, "the cell's {:.2f}× is that, diluted by the cache read. At 7B (t = 4) the cell is {:.2f}×",
                 cells["1.5b@h100:8"]["ratio_to_floor"], cells["7b@h100:8"]["ratio_to_floor"])
    yield from q(ROLLOUT, "an array of its own (below) | {:.2f} | {:.2f} |",
                 cells["27b@h100:8"]["decode_step"]["hbm_bytes"] / 1e9, cells["27b@h100:8"]["ratio_to_floor"])


def _rollout_jax_versions() -> Iterator[Quote]:
    """The 27b@h100:8 rollout planned with the engine's weights stacked and per layer, on both locks' jaxlib."""
    for layout, jaxlib in itertools.product(("stacked", "per_layer"), ("0.10.2", "0.12.0.1")):
        source = f"experiments/rollout/jax_versions/{layout}_jax{jaxlib}.json"
        plan = _json(source)
        assert plan["jax"] == jaxlib, (source, plan["jax"])
        rollout = next(p for p in plan["phases"] if p["name"] == "rollout")
        step = rollout["per_decode_step"]
        yield from _quoter(source)(
            ROLLOUT, f"| {layout.replace('_', ' ')} | {jaxlib} | {{:.2f}} | {{:.2f}} | {{:.0f}} s |",
            step["hbm_bytes"] / 1e9, step["est_seconds"] / step["floor_seconds"], rollout["time"]["est_seconds"])


# --- learning: experiments/sweep.py's results files ------------------------------------------------------------

class Contender(NamedTuple):
    """One variant of a sweep's results file: held-out accuracy after RL (mean, std, per seed), before RL (mean)
    and the largest drop between evaluations of its worst seed."""

    after: float
    std: float
    before: float
    per_seed: dict[int, float]
    drop: float


def _sweep(path: str) -> dict[str, Contender]:
    """A sweep's results by contender: the name before "@step size" (one best step size per contender), or the
    whole name where a contender has several."""
    variants = _json(path)["variants"]
    short = [name.split("@")[0] for name in variants]
    out = {}
    for (name, v), key in zip(variants.items(), short, strict=True):
        seeds = v["seeds"]
        out[key if short.count(key) == 1 else name] = Contender(
            v["mean_std"]["accuracy_after"][0], v["mean_std"]["accuracy_after"][1],
            v["mean_std"]["accuracy_before"][0], {s["seed"]: s["accuracy_after"] for s in seeds},
            max(s.get("largest_drop", math.nan) for s in seeds))
    return out


def _paired(a: Contender, b: Contender) -> list[float]:
    """a − b per seed both ran, in points."""
    return [100 * (a.per_seed[s] - b.per_seed[s]) for s in a.per_seed if s in b.per_seed]


def _md_tables(path: str) -> list[list[dict[str, str]]]:
    """The markdown tables of a results .md file, each as rows keyed by its header."""
    tables, rows, header = [], [], None
    for line in [*(ROOT / path).read_text(encoding="utf-8").splitlines(), ""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if header:
                tables.append(rows)
            rows, header = [], None
        elif header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            rows.append(dict(zip(header, cells, strict=True)))
    return tables


def _parity() -> Iterator[Quote]:
    q = _quoter("experiments/parity/demo/best.json")
    demo = _sweep("experiments/parity/demo/best.json")
    adamw, layer, kl, fixed = demo["adamw-targets"], demo["logra-layer"], demo["logra-kl"], demo["logra-fixed"]
    frozen_drop = _bound(max(layer.drop, kl.drop, fixed.drop), 0.10)
    behind = 100 * (adamw.after - layer.after)
    yield from q(REPORT, "on the demo task AdamW on LoGRA's targets reaches {:.3f} ± {:.3f} held-out, LoGRA {:.3f} ± "
                         "{:.3f} with a per-layer update ratio ({:.3f} with the KL controller, {:.3f} with the paper's "
                         "global ratio); no seed of LoGRA with frozen non-targets drops > {:.2f}",
                 adamw.after, adamw.std, layer.after, layer.std, kl.after, fixed.after, frozen_drop)
    yield from q(REPORT, "held-out {:.3f} ± {:.3f} AdamW on the targets only, {:.3f} AdamW on all parameters, "
                         "{:.3f} GaLore, **{:.3f} ± {:.3f} LoGRA with a per-layer update ratio** (our remedy), "
                         "{:.3f} ± {:.3f} LoGRA with the KL controller, {:.3f} with the paper's fixed global ratio; "
                         "no seed of LoGRA with frozen non-targets drops > {:.2f} between evaluations ({:.3f} with "
                         "AdamW on the non-targets)",
                 adamw.after, adamw.std, demo["adamw-all"].after, demo["galore"].after, layer.after, layer.std,
                 kl.after, kl.std, fixed.after, frozen_drop, demo["logra-nt-adamw"].drop)
    yield from q(REPORT, "(dense RowAdam: {:.3f})", demo["rowadam-dense"].after)
    yield from q(REPORT, "dense RowAdam without any sketch: {:.3f}", demo["rowadam-dense"].after)
    yield from q(REPORT, "the paper's rule (per-layer ratio) is {:.1f} points behind AdamW on the same weights", behind)
    yield from q(REPORT, "the paper's rule (per-layer ratio) trails AdamW on the same weights by {:.1f} points", behind)
    yield from q(METHOD, "the per-layer ratio reaches {:.3f} ± {:.3f} held-out against {:.3f} for the global one",
                 layer.after, layer.std, fixed.after)
    yield from q(METHOD, "`experiments/parity`: {:.3f} against AdamW's {:.3f} on the demo task",
                 demo["rowadam-dense"].after, adamw.after)

    q = _quoter("experiments/parity/demo_momentum/results.json")
    b1 = _sweep("experiments/parity/demo_momentum/results.json")
    b1zero = max((c for name, c in b1.items() if name.startswith("adamw-targets-b1zero")), key=lambda c: c.after)
    yield from q(REPORT, "AdamW without its first moment falls to LoGRA's level ({:.3f} vs {:.3f}, 2 seeds)",
                 b1zero.after, b1["logra-layer"].after)

    q = _quoter("experiments/parity/three_digit/best.json")
    three = _sweep("experiments/parity/three_digit/best.json")
    adamw3, layer3 = three["adamw-targets"], three["logra-layer"]
    logra3 = [c for name, c in three.items() if name.startswith("logra")]
    paired = _paired(layer3, adamw3)
    learnt = [c.after for c in three.values()]
    yield from q(REPORT, "On a second task (three-digit additions) LoGRA is level with AdamW ({:.3f} vs {:.3f}, "
                         "5 seeds)",
                 layer3.after, adamw3.after)
    yield from q(REPORT, "AdamW on the targets {:.3f} ± {:.3f}, **LoGRA per-layer {:.3f} ± {:.3f}**, per-layer + KL "
                         "controller {:.3f} ± {:.3f}, the paper's global ratio + KL controller {:.3f} ± {:.3f} "
                         "(held-out before RL {:.3f}; no LoGRA seed drops > {:.3f}); ablations there: AdamW all "
                         "{:.3f}, GaLore {:.3f}, LoGRA fixed global ratio {:.3f}, + AdamW non-targets {:.3f}, dense "
                         "RowAdam {:.3f}",
                 adamw3.after, adamw3.std, layer3.after, layer3.std, three["logra-layer-kl"].after,
                 three["logra-layer-kl"].std, three["logra-kl"].after, three["logra-kl"].std, layer3.before,
                 max(c.drop for c in logra3), three["adamw-all"].after, three["galore"].after,
                 three["logra-fixed"].after, three["logra-nt-adamw"].after, three["rowadam-dense"].after)
    rise = 100 * (layer3.after - three["logra-fixed"].after)
    yield from q(REPORT, "per-layer ratio {:+.1f} points over the global one", rise)
    yield from q(METHOD, "and {:+.1f} points on a second task", rise)
    every = _all(sum(d >= 0 for d in paired), len(paired))
    yield from q(REPORT, "({:+.1f} points paired over {:.0f} seeds, ≥ AdamW on every seed), though there every "
                         "contender learns little ({:.1%} → {:.0f}–{:.0f}%)",
                 statistics.mean(paired), every, layer3.before, 100 * min(learnt), 100 * max(learnt))


def _momentum() -> Iterator[Quote]:
    q = _quoter("experiments/momentum/memory/results.json")
    cell = _cpu_gib("experiments/momentum/memory/results.json", "Qwen2.5-Math-7B@4dev")
    cost = cell["logra_sketch_native_kl_momentum"] - cell["logra_sketch_native_kl"]
    share = cost / cell["logra_sketch_native_kl"]
    yield from q(REPORT, "+{:.2f} GiB = +{:.1%} per device at 7B@4", cost, share)
    yield from q(METHOD, "the stage costs its state, +{:.2f} GiB (+{:.1%}) per device at 7B@4", cost, share)
    yield from q(("experiments/momentum/README.md",), "| {:.2f} GiB ({:.0%} of AdamW-targets) | {:.2f} GiB ({:.0%}) | "
                  "+{:.2f} GiB, **+{:.1%}** |", cell["logra_sketch_native_kl"],
                 cell["logra_sketch_native_kl"] / cell["adamw_targets"], cell["logra_sketch_native_kl_momentum"],
                 cell["logra_sketch_native_kl_momentum"] / cell["adamw_targets"], cost, share)

    q = _quoter("experiments/momentum/demo/best.json, experiments/parity/demo/best.json")
    demo = _sweep("experiments/momentum/demo/best.json")
    m, adamw, rule = demo["logra-layer-m0.9-kinf"], demo["adamw-targets"], demo["logra-layer"]
    parity_before = _sweep("experiments/parity/demo/best.json")["adamw-targets"].before
    yield from q(REPORT, "({:.3f} vs {:.3f} held-out, 5 seeds, swept alike; the rule without it {:.3f}; this "
                         "study's own SFT warm starts, which leave {:.3f} held-out before RL against the parity "
                         "study's {:.3f})",
                 m.after, adamw.after, rule.after, m.before, parity_before)
    yield from q(REPORT, "level with it ({:.3f} vs {:.3f}, 5 seeds, `experiments/momentum`, its own warm starts)",
                 m.after, adamw.after)
    yield from q(REPORT, "{:.3f} vs AdamW-targets {:.3f} (the rule without it {:.3f}; 5 seeds, swept alike, this "
                         "study's warm starts)", m.after, adamw.after, rule.after)

    q = _quoter("experiments/momentum/three_digit/best.json")
    three = _sweep("experiments/momentum/three_digit/best.json")
    level = statistics.mean(_paired(three["logra-layer-m0.9-kinf"], three["logra-layer"]))
    yield from q(REPORT, "three-digit additions it is level ({:+.1f} points paired)", level)
    yield from q(REPORT, "It is level on three-digit additions ({:+.1f} points paired)", level)

    q = _quoter("experiments/momentum/demo/alone.json")
    alone = _sweep("experiments/momentum/demo/alone.json")
    fixed = statistics.mean(_paired(alone["logra-layer-kinf"], alone["logra-layer"]))
    with_m = statistics.mean(_paired(alone["logra-layer-m0.9-kinf"], alone["logra-layer"]))
    yield from q(REPORT, "the fixed projection without momentum changes nothing either ({:+.1f} points, 3 seeds; the "
                         "momentum with it {:+.1f} on the same seeds)", fixed, with_m)

    q = _quoter("experiments/momentum/demo/rank.json")
    rank = _sweep("experiments/momentum/demo/rank.json")
    fresh = [rank[f"logra-layer-r{r}"] for r in (4, 16)] + [rank["logra-layer"]]
    fixed_m = [rank[f"logra-layer-m0.9-kinf-r{r}"] for r in (4, 16)] + [rank["logra-layer-m0.9-kinf"]]
    spread = [c.std for c in fresh + fixed_m]
    yield from q(REPORT, "r 4 / 16 / 64 → {:.3f} / {:.3f} / {:.3f} held-out (paper's rule, fresh projections) and "
                         "{:.3f} / {:.3f} / {:.3f} (momentum 0.9, fixed projection), seed spread {:.0f}–{:.0f} points",
                 *(c.after for c in fresh), *(c.after for c in fixed_m), 100 * min(spread), 100 * max(spread))
    run = rank["logra-layer-m0.9-kinf"]
    q = _quoter("experiments/momentum/demo/rank.json, experiments/momentum/demo/best.json")
    xeon = demo["logra-layer-m0.9-kinf"]
    yield from q(README, "({:.1%} → {:.1%} for seed 0 on a 2-core AMD EPYC, {:.1%} → {:.1%} on a 2-core Intel Xeon;",
                 _seed_before("experiments/momentum/demo/rank.json", "logra-layer-m0.9-kinf", 0), run.per_seed[0],
                 _seed_before("experiments/momentum/demo/best.json", "logra-layer-m0.9-kinf", 0), xeon.per_seed[0])


def _seed_before(path: str, contender: str, seed: int) -> float:
    variants = _json(path)["variants"]
    name = next(n for n in variants if n.split("@")[0] == contender)
    return next(s["accuracy_before"] for s in variants[name]["seeds"] if s["seed"] == seed)


def _smollm2() -> Iterator[Quote]:
    q = _quoter("experiments/smollm2/tune/best.json")
    tune = _sweep("experiments/smollm2/tune/best.json")
    layer, adamw = tune["logra-layer"], tune["adamw-targets"]
    paired = _paired(layer, adamw)
    before = [s["accuracy_before"] for v in _json("experiments/smollm2/tune/best.json")["variants"].values()
              for s in v["seeds"]]
    yield from q(REPORT, "{:.3f} ± {:.3f} vs {:.3f} ± {:.3f} held-out after 40 RL steps with both step sizes swept, "
                         "{:+.1f} points paired, ahead on {:d} of 3 seeds", layer.after, layer.std, adamw.after,
                 adamw.std, statistics.mean(paired), sum(d > 0 for d in paired))
    yield from q(REPORT, "{:.3f} ± {:.3f} vs {:.3f} ± {:.3f}, {:+.1f} points paired, {:d} of 3 seeds", layer.after,
                 layer.std, adamw.after, adamw.std, statistics.mean(paired), sum(d > 0 for d in paired))
    yield from q(REPORT, "after a 40-step SFT warm start ({:.0f}–{:.0%} held-out on two-digit additions)",
                 100 * min(before), max(before))
    yield from q(REPORT, "held-out {:.3f} ± {:.3f} LoGRA (per-layer ratio 5e-5) vs {:.3f} ± {:.3f} AdamW on the "
                         "targets (lr 3e-6), 3 seeds ({:+.1f}, {:+.1f}, {:+.1f} points;",
                 layer.after, layer.std, adamw.after, adamw.std, *paired)
    yield from q(METHOD, "there the rule without it leads tuned AdamW by {:.1f} points over 3 seeds",
                 statistics.mean(paired))

    q = _quoter("experiments/smollm2/tune/sweep.json")
    sweep = _sweep("experiments/smollm2/tune/sweep.json")
    best_m = max(c.after for name, c in sweep.items() if name.startswith("logra-layer-m0.9-kinf"))
    best_rule = max(c.after for name, c in sweep.items() if name.startswith("logra-layer@"))
    behind = 100 * (best_rule - best_m)
    yield from q(REPORT, "on SmolLM2-135M {:.1f} points behind the rule without it", behind)
    yield from q(REPORT, "{:.1f} points behind the rule without it on SmolLM2-135M ({:.3f} vs {:.3f}, each at its best "
                         "swept ratio, seed 0)", behind, best_m, best_rule)
    yield from q(METHOD, "{:.1f} points behind it on SmolLM2-135M", behind)

    q = _quoter("experiments/smollm2/parity/results.json")
    matched = _json("experiments/smollm2/parity/results.json")["variants"]
    ms = {name: v["mean_std"] for name, v in matched.items()}
    step_bytes = {name: v["seeds"][0]["step_bytes"] for name, v in matched.items()}
    yield from q(REPORT, "at matched, untuned step sizes {:.3f} vs {:.3f} (2 seeds); {:.1f} vs {:.1f} s per step, "
                         "train-step bytes {:.2f}×", ms["logra-layer"]["accuracy_after"][0],
                 ms["adamw-targets"]["accuracy_after"][0], ms["logra-layer"]["step_time_median"][0],
                 ms["adamw-targets"]["step_time_median"][0], step_bytes["logra-layer"] / step_bytes["adamw-targets"])

    q = _quoter("experiments/smollm2/results.json")
    first = {name: v["seeds"][0] for name, v in _json("experiments/smollm2/results.json")["variants"].items()}
    lo, ad = first["logra"], first["adamw-lr1e-6"]
    yield from q(REPORT, "LoGRA's train step {:.2f} vs {:.2f} GiB compile-only (−{:.0%}), process peak RSS {:.2f} vs "
                         "{:.2f} GiB (−{:.0%}), {:.1f} vs {:.1f} s per step ({:.2f}×); learning too short to compare "
                         "({:.0f} → {:.1%} held-out for LoGRA, {:.0f} → {:.0%} AdamW, one seed)",
                 lo["step_bytes"] / GIB, ad["step_bytes"] / GIB, 1 - lo["step_bytes"] / ad["step_bytes"],
                 lo["peak_rss_bytes"] / GIB, ad["peak_rss_bytes"] / GIB,
                 1 - lo["peak_rss_bytes"] / ad["peak_rss_bytes"],
                 lo["step_time_median"], ad["step_time_median"], lo["step_time_median"] / ad["step_time_median"],
                 100 * lo["accuracy_before"], lo["accuracy_after"], 100 * ad["accuracy_before"], ad["accuracy_after"])


def _ablations() -> Iterator[Quote]:
    q = _quoter("experiments/ablations/results.json")
    a = _sweep("experiments/ablations/results.json")
    yield from q(REPORT, "earlier, unswept: {:.2f} / {:.2f} / {:.2f} / {:.2f} for r 4 / 16 / 64 / 128, 2 seeds",
                 a["r4"].after, a["r16"].after, a["r64 (demo)"].after, a["r128 (width)"].after)
    yield from q(REPORT, "refresh off {:.2f}, Gaussian {:.2f} vs {:.2f} (same spread)", a["refresh off"].after,
                 a["gaussian"].after, a["r64 (demo)"].after)


# --- the predicted-KL controller -------------------------------------------------------------------------------

def _kl() -> Iterator[Quote]:
    q = _quoter("experiments/kl/results.json")
    steps = _json("experiments/kl/results.json")
    worst = {model: max((1 + r["controlled_relative_error"] for r in rows), key=lambda x: abs(x - 1))
             for model, rows in steps.items()}
    raw = {r["ratio"]: r["realised"] / r["predicted"] for r in steps["smollm2-135m"]}
    yield from q(REPORT, "matches the realised KL within {:.0%} once the controller has sized the step",
                 max(abs(x - 1) for x in worst.values()))
    yield from q(REPORT, "(realised/predicted {:.2f} → {:.3f})", raw[3e-4], raw[max(raw)])
    yield from q(REPORT, "realised / predicted KL of a controlled step {:.3f} (tiny model) and {:.3f} (SmolLM2-135M)",
                 worst["tiny"], worst["smollm2-135m"])
    yield from q(METHOD, "We measure realised/predicted {:.3f} (tiny model) and {:.3f} (SmolLM2-135M)",
                 worst["tiny"], worst["smollm2-135m"])

    q = _quoter("experiments/kl/control/results.json, experiments/kl/control/results.md")
    runs = _sweep("experiments/kl/control/results.json")
    sized = [runs[name].after for name in ("kl off", "budget ×0.25", "budget ×1 (demo)", "budget ×4")]
    controlled = [(row["variant"], re.findall(r"[\d.]+", row["realised / predicted: median (p10–p90)"]))
                  for row in _md_tables("experiments/kl/control/results.md")[1] if row["variant"] != "kl off"]
    medians = [float(m) for variant, (m, _, _) in controlled if "ratio" not in variant]  # the steps it sized
    p90 = [float(p) for _, (_, _, p) in controlled]
    yield from q(REPORT, "final accuracy {:.2f}–{:.2f}, differences within the seed spread", min(sized), max(sized))
    yield from q(REPORT, "the prediction's median realised/predicted is {:.2f}–{:.2f} but one step in ten realises "
                         "{:.1f}–{:.0f}× its prediction", min(medians), max(medians), min(p90), max(p90))
    yield from q(METHOD, "one controlled step in ten realising {:.1f}–{:.0f}× its prediction", min(p90), max(p90))


# --- systems: sync, sketch-native step time, several hosts -----------------------------------------------------

def _sync() -> Iterator[Quote]:
    q = _quoter("experiments/sync/bench.json")
    rows = {(r["model"], r["rank"]): r for r in _json("experiments/sync/bench.json")["computed"]}
    r256, r64 = rows["qwen2.5-7b", 256], rows["qwen2.5-7b", 64]
    yield from q(REPORT, "{:.2f} GiB per update at 7B, r = 256 = {:.2%} of the bf16 target weights",
                 r256["lowrank_delta_bytes"] / GIB, r256["ratio_vs_bf16_targets"])
    yield from q(REPORT, "{:.3f} GiB = {:.2%} at 7B r = 256 ({:.2%} at r = 64)", r256["lowrank_delta_bytes"] / GIB,
                 r256["ratio_vs_bf16_targets"], r64["ratio_vs_bf16_targets"])
    yield from q(METHOD, "that is {:.3f} GiB per update, {:.2%} of the {:.2f} GiB of bf16 target weights",
                 r256["lowrank_delta_bytes"] / GIB, r256["ratio_vs_bf16_targets"], r256["bf16_target_bytes"] / GIB)


def _sketch_native() -> Iterator[Quote]:
    q = _quoter("experiments/sketch_native/results.json, experiments/sketch_native/tokens1024/results.json")
    short = _json("experiments/sketch_native/results.json")["step_time"]
    long = _json("experiments/sketch_native/tokens1024/results.json")["step_time"]

    def cpu(t: dict[str, Any]) -> float:
        return t["median_cpu_seconds"]["logra_sketch_native"] / t["median_cpu_seconds"]["adamw"]

    yield from q(REPORT, "{:.2f}× (256 tokens) and {:.2f}× (1024 tokens) wall, {:.2f}× / {:.2f}× CPU time",
                 short["ratio_to_adamw"]["logra_sketch_native"], long["ratio_to_adamw"]["logra_sketch_native"],
                 cpu(short), cpu(long))


def _multihost() -> Iterator[Quote]:
    q = _quoter("experiments/multihost/results.json")
    r = _json("experiments/multihost/results.json")
    same = r["one_gloo"]
    params = max(v for k, v in r["one_inprocess"]["leaves"].items() if "['params']" in k)
    yield from q(REPORT, "(every metric, all {:.0f} checkpointed leaves, KL control on);",
                 _all(same["bitwise_leaves"], same["float_leaves"]) if not same["metrics_differing"] else math.nan)
    yield from q(REPORT, "the parameters differ by ≤ {:.1e} of their largest entry", params)


# --- the paper's figures, as docs/method.md quotes them --------------------------------------------------------

def _paper_claims() -> Iterator[Quote]:
    q = _quoter("docs/method.md")
    yield from q(REPORT, "7B: LoGRA {:.2f} GiB vs dense Adam {:.2f} GiB per GPU (−{:.1f}%)", _paper("17.29 GiB"),
                 _paper("31.82 GiB"), _paper("45.7%"))
    yield from q(REPORT, "1.5B: {:.2f} vs {:.2f} GiB (−{:.1f}%)", _paper("7.18 GiB"), _paper("9.18 GiB"),
                 _paper("21.8%"))
    yield from q(REPORT, "dense Adam out of memory, LoGRA {:.2f} GiB", _paper("51.54 GiB"))
    yield from q(REPORT, "NeMo port: {:.0f} vs {:.0f} ms per iteration against dense AdamW ({:.2f}×)",
                 _paper("384 ms"), _paper("500 ms"), _paper("384 ms") / _paper("500 ms"))
    yield from q(REPORT, "(~{:.2f} GiB, ~{:.1f}% of bf16 target weights at 7B, r = 256)",
                 _paper("~0.66 GiB", "§6"), _paper("~5.5%", "§6"))
    yield from q(REPORT, "(Pass@1 1.5B: {:.2f} LoGRA vs {:.2f} dense; 7B ~{:.1f} both)", _paper("67.87"),
                 _paper("63.77"), _paper("~72.3"))
    yield from q(REPORT, "Rank matters most (r 4 → 256 ≈ +{:.0f} points)", _paper("+3 points"))
    yield from q(REPORT, "27B ran > {:,.0f} steps stably", _paper("1,100"))


def _vllm() -> Iterator[Quote]:
    q = _quoter("experiments/vllm/{rl,throughput}.json")
    record = _json("experiments/vllm/rl.json")
    runs = record["runs"]

    def sync(name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # a vLLM run's publications, bootstrap
        syncs = runs[name]["syncs"]
        return [x for x in syncs if x["kind"] == "publish"], next(x for x in syncs if x["kind"] == "bootstrap")

    (deltas, boot), (busy, busy_boot) = sync("vllm-seed2"), sync("vllm-seed0")  # seed 2's ran alone
    full = boot["full_weight_bytes"]["float32"]
    delta_bytes = statistics.median(x["bytes"] for x in deltas)
    yield from q(VLLM, "low-rank sync of SmolLM2-135M (rank 64) ships {:.1f} MB, {:.1%} of its float32 weights "
                       "({:.0f} MB), in {:.1f} s (median of {:.0f}, the run alone on the machine; vLLM's reload "
                       "{:.1f} s and the merge of U·A {:.1f} s of it), against {:.1f} s for the full float32 "
                       "snapshot ({:.1f} against {:.1f} s on a busy machine)",
                 delta_bytes / 1e6, delta_bytes / full, full / 1e6, statistics.median(x["seconds"] for x in deltas),
                 len(deltas), statistics.median(x["engine_seconds"]["reload"] for x in deltas),
                 statistics.median(x["engine_seconds"]["apply"] for x in deltas), boot["seconds"],
                 statistics.median(x["seconds"] for x in busy), busy_boot["seconds"])
    diff = record["paired_vllm_minus_jax"]
    seeds = diff["seeds"]
    vllm_runs = [runs[f"vllm-seed{k}"] for k in seeds]
    jax_runs = [runs[f"jax-seed{k}"] for k in seeds]
    published = [x for r in vllm_runs for x in r["syncs"] if x["kind"] == "publish"]
    yield from q(VLLM + REPORT, "the largest |W_vllm − W_trainer| after any of the {:.0f} publications of the "
                                "{:.0f} vLLM runs was {:g}, with {:.0f} resyncs", len(published), len(vllm_runs),
                 max(x["drift_max"] for x in published), sum(r["syncs"][-1]["resyncs"] for r in vllm_runs))
    mismatch = lambda rs: statistics.median(x["rollout_mismatch"] for r in rs for x in r["steps"])
    yield from q(VLLM, "mismatch the TIS cap sees (`rollout_mismatch`, median over the steps of {:.0f} runs each) "
                       "was {:.1e} with vLLM and {:.1e} with ours", len(seeds), mismatch(vllm_runs),
                 mismatch(jax_runs))
    acc = diff["accuracy_after"]
    after = lambda rs: [r["summary"]["accuracy_after"] for r in rs]
    yield from q(VLLM + REPORT, "held-out accuracy after 40 RL steps from the same warm starts was {:.3f} ± {:.3f} "
                                "with vLLM rollouts and {:.3f} ± {:.3f} with ours ({:.0f} seeds); paired per seed, "
                                "vLLM − ours is {:+.3f} ± {:.3f}, {:.0%} Student-t interval {:+.3f} … {:+.3f}: level",
                 statistics.fmean(after(vllm_runs)), statistics.stdev(after(vllm_runs)),
                 statistics.fmean(after(jax_runs)), statistics.stdev(after(jax_runs)), len(seeds),
                 _if_level(acc, acc["mean"]), acc["std"], acc["level"], *acc["interval"])
    rates = {(r["case"], r["impl"]): r["tokens_per_s"] for r in _json("experiments/vllm/throughput.json")["results"]}
    yield from q(VLLM, "build decoded {:.1f} response tokens/s against our engine's {:.1f} on 32 prompts × 128 "
                       "tokens, and {:.1f} against {:.1f} with RL-like lengths: vLLM is {:.1f}× and {:.1f}× faster",
                 rates[("smollm2-fixed", "vllm")], rates[("smollm2-fixed", "ours")], rates[("smollm2-spread", "vllm")],
                 rates[("smollm2-spread", "ours")], rates[("smollm2-fixed", "vllm")] / rates[("smollm2-fixed", "ours")],
                 rates[("smollm2-spread", "vllm")] / rates[("smollm2-spread", "ours")])


def quotes() -> list[Quote]:
    """Every registered quote, with its figures computed from today's results files."""
    sources = (_memory, _memory_targets, _bf16_learning, _bf16_smollm2, _step_cost, _whole_job, _fits, _dropin,
               _rollout_plans, _rollout_jax_versions, _parity, _momentum, _smollm2, _ablations, _kl, _sync,
               _sketch_native, _multihost, _paper_claims, _vllm)
    return [quote for source in sources for quote in source()]
