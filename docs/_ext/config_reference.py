"""The configuration reference, generated from logra_jax/job/run_config.py at every docs build.

Every field of every `RunConfig` section is listed with its type, its default (both read from the dataclasses)
and its meaning. The meaning is FIELD_MEANINGS' entry for "section.field" — where `{NAME}` stands for the
registry tuple `logra_jax.job.run_config.NAME`, so the allowed values are the code's own — or, for a field without an
entry, the clause of its section's docstring that names it. A field with neither stops the build
(`missing_meanings`, checked by tests/docs/test_docs_config_reference.py in `make test` too), and so does an
entry for a field that no longer exists: the reference cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tests import this module without Sphinx
    from sphinx.application import Sphinx

# "section.field" → meaning (Markdown). Defaults and types come from the code; do not repeat them here.
FIELD_MEANINGS: dict[str, str] = {
    "model.preset": "Named model configuration, one of {PRESETS}; ignored when `checkpoint` is set.",
    "model.checkpoint": "A Hugging Face checkpoint directory (safetensors) or a GGUF file; \"\" builds the preset "
                        "with random weights.",
    "model.overrides": "Model-config fields to change on top of the preset, e.g. `{\"num_layers\": 4, \"dtype\": "
                       "\"bfloat16\"}`.",
    "model.tokenizer": "`\"char\"` (a character tokenizer for the synthetic tasks) or `\"checkpoint\"` (the "
                       "checkpoint's own; needs `checkpoint`).",
    "model.init_seed": "Seed of the random initialisation.",
    "task.kind": "The RL task: generated (one of {GENERATED_KINDS}) or `\"jsonl\"` (GSM8K/MATH-style files).",
    "task.difficulty": "Arithmetic: digits per operand.",
    "task.operations": "Arithmetic: the operators drawn from, a subset of `+-*`.",
    "task.count": "Countdown: numbers per problem.",
    "task.max_number": "Countdown: numbers are drawn from [1, max_number].",
    "task.max_target": "Countdown: targets lie in [1, max_target].",
    "task.train_size": "Problems in the training split (generated tasks).",
    "task.eval_size": "Problems in the held-out split.",
    "task.jsonl_train": "Training JSONL file (`kind=\"jsonl\"`).",
    "task.jsonl_eval": "Held-out JSONL file (`kind=\"jsonl\"`).",
    "task.seed": "Seed of the task generator.",
    "task.prompt_style": "How a problem is shown: one of {PROMPT_STYLES} (`compact`: arithmetic as `12+7=`).",
    "task.carries": "Additions only: `\"any\"`, `\"none\"` (no carry between operand columns) or `\"some\"` (at "
                    "least one).",
    "sft.steps": "Supervised warm-start steps before RL (0 = no warm start).",
    "sft.batch_size": "Warm-start batch size.",
    "sft.learning_rate": "Warm-start AdamW learning rate.",
    "sft.difficulty": "Digits per operand of the warm start's (easier) arithmetic demonstrations.",
    "sft.operations": "Operators of the demonstrations.",
    "sft.train_size": "Number of easier demonstrations.",
    "sft.carries": "Carries of the demonstrations' additions (as `task.carries`).",
    "sft.task_examples": "Problems of the RL task itself added to the demonstrations (generated tasks only; "
                         "held-out problems never are).",
    "sft.cache_dir": "When set, the warm-start weights are stored there, keyed by everything they depend on, and "
                     "reused by later runs with the same key.",
    "sft.max_final_loss": "The run stops with a `WarmStartError` naming the seed and the loss when the warm start's "
                          "final loss (the mean of its last 5% of steps) is above this, before RL; 0 = not checked.",
    "rollout.prompts_per_step": "Prompts per RL update (a multiple of `mesh_data × mesh_fsdp` on several "
                                "hosts).",
    "rollout.num_samples": "Responses sampled per prompt (the group size of GRPO-style estimators).",
    "rollout.max_new_tokens": "Longest response, in tokens.",
    "rollout.temperature": "Sampling temperature (also the temperature of the trainer's log-probs and of the KL "
                           "probe).",
    "rollout.top_k": "Top-k sampling (0 = off).",
    "rollout.top_p": "Nucleus sampling (1 = off).",
    "rollout.slots": "Rows the engine decodes at once (continuous batching): the KV cache holds `slots` rows "
                     "and a finished row's slot takes the next waiting prompt × sample; 0 = every row at once.",
    "rollout.decode_steps": "Decode steps the engine runs between two looks at which rows finished (refills).",
    "rollout.length_buckets": "Decode attends over the filled part of the KV cache, in this many length steps "
                              "(one compiled decode step per step used).",
    "rollout.engine": "`jax`: our engine (colocated or a worker process, by `workers`); `vllm`: vLLM in its own "
                      "process from `make venv-vllm`'s venv, fed by low-rank sync (single-process runs).",
    "rollout.vllm_python": "The vLLM venv's interpreter (`make venv-vllm` makes `.venv-vllm/bin/python`).",
    "rollout.vllm_tensor_parallel": "vLLM's tensor-parallel size.",
    "rollout.vllm_memory_fraction": "vLLM's GPU memory fraction (its CPU build ignores it).",
    "rollout.vllm_dtype": "The dtype vLLM holds and computes in: float32, bfloat16 or float16.",
    "rollout.vllm_max_seqs": "Sequences vLLM decodes at once.",
    "rollout.vllm_kv_cache_gib": "vLLM's CPU KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).",
    "rollout.vllm_devices": "CUDA_VISIBLE_DEVICES for vLLM (empty: unchanged).",
    "rollout.decode_tensor": "The colocated engine's tensor-parallel group size t: its compute-dtype weights are "
                             "split over t devices and replicated over the n / t groups, each decoding its own "
                             "slots; 0 = chosen from the model and the devices.",
    "rollout.decode_layers": "How the colocated engine holds the blocks' weights, one of {DECODE_LAYERS}: "
                             "`per_layer` (each layer's weights arrays of their own, cut out of the trainer's stacks "
                             "at every publish: XLA:GPU reads them in place, where it copies a stack's slices in "
                             "every decode step), `stacked` (the trainer's stacks, shared with the trainer where "
                             "dtype and layout match: no second copy of the weights) or `auto` (per_layer on GPUs, "
                             "stacked elsewhere).",
    "rollout.engine_devices": "k > 0: our JAX engine runs in the trainer's process on the last k devices, a mesh of "
                              "its own (decode layout), fed device to device by low-rank policy sync; the trainer's "
                              "mesh takes the other devices. 0: the colocated engine on the trainer's devices.",
    "rollout.max_staleness": "0: rollout, then training, in sequence. k ≥ 1: the engine generates the next k batches "
                             "while the trainer trains, each trained k policy versions after the one that generated "
                             "it (needs an engine on devices of its own: `engine_devices`, `workers = 1` or vLLM).",
    "rollout.max_stale_kl": "A batch is trained only while the predicted KL of the updates since its policy version "
                            "(the sum of the controller's predictions) is within this budget; 0 = no bound. Needs "
                            "`optimizer.kl_control` and `max_staleness ≥ 1`.",
    "rollout.stale_action": "What happens to a batch over `max_stale_kl`: `regenerate` (with the current policy) or "
                            "`clip` (trained with its importance weights capped at `stale_tis_cap`).",
    "rollout.stale_tis_cap": "The cap of a stale batch's importance weights under `stale_action = \"clip\"` "
                             "(below `algorithm.tis_cap`: clipped harder).",
    "rollout.engine_cpus": "The CPUs the worker process of `workers = 1` (and every thread it starts) runs on, as "
                           "taskset's list (`\"1\"`, `\"2-3\"`); empty: this process's.",
    "rollout.engine_restarts": "How many times an engine process that dies or fails a request is restarted from the "
                               "trainer's weights (the batches it lost asked again; the synchronous loop's result "
                               "unchanged) before the run stops naming the engine and its last output.",
    "rollout.workers": "0: the rollout engine runs in the trainer's process; 1: a separate rollout worker "
                       "process, synchronised with low-rank payloads (method §6).",
    "algorithm.estimator": "Advantage estimator, one of {ESTIMATORS}.",
    "algorithm.baseline_momentum": "`reinforce`: weight m of the running baseline's EMA (paper: 0.1).",
    "algorithm.whiten": "`reinforce++`: one of {WHITENINGS}; `response` counts every response once, `token` "
                        "weights each by its length (verl's).",
    "algorithm.policy": "Policy loss, one of {POLICIES}.",
    "algorithm.eps_low": "PPO clip range below 1.",
    "algorithm.eps_high": "PPO clip range above 1 (above `eps_low`: clip-higher).",
    "algorithm.tis_cap": "Truncated importance sampling cap C on exp(log π_old − log μ) (paper: 2; 0 = off).",
    "algorithm.aggregation": "How token losses are averaged, one of {AGGREGATIONS}.",
    "algorithm.kl_beta": "Weight of a reference-KL penalty (0 = none, the paper's).",
    "algorithm.reward_correct": "Reward of a verified answer (paper: 1).",
    "algorithm.reward_incorrect": "Reward of anything else (paper: −0.01).",
    "algorithm.format_weight": "Bonus for a well-formed final answer (0 = off).",
    "algorithm.dynamic_sampling": "Zero the advantages of groups whose rewards are all equal (DAPO's dynamic "
                                  "sampling, as a mask).",
    "optimizer.name": "The optimizer, one of {OPTIMIZER_NAMES}.",
    "optimizer.targets_only": "AdamW: train exactly LoGRA's targets, the rest frozen (like-for-like "
                              "comparisons).",
    "optimizer.learning_rate": "AdamW, GaLore, Adafactor, and LoGRA's `nemo` variant.",
    "optimizer.weight_decay": "AdamW, GaLore, LoGRA `nemo` (decoupled).",
    "optimizer.grad_clip": "Global-norm gradient clipping for AdamW and GaLore (0 = off).",
    "optimizer.adam_b1": "AdamW's β₁ (0 drops the first moment, as RowAdam has none).",
    "optimizer.rank": "Sketch rank r of LoGRA (method §2; the paper uses 256), and GaLore's rank.",
    "optimizer.rank_rules": "Per-target LoGRA ranks, `\"pattern=rank, pattern=rank\"`: a target whose parameter path "
                            "a pattern (regex) matches takes the first such rule's rank, the others `optimizer.rank` "
                            "(e.g. `\"mlp=8\"` gives MoE experts rank 8); each rule must match a target and each rank "
                            "fit its target's width. `\"\"`: none.",
    "optimizer.variant": "RowAdam variant, one of {ROW_ADAM_VARIANTS} (method §4).",
    "optimizer.update_ratio": "Update-to-weight norm ratio of the `paper` and `sgd` variants (method §4).",
    "optimizer.ratio_scope": "One of {SCOPES}: `global` (the paper's, one ratio for all targets together) or "
                             "`layer` (each layer moves by update_ratio of its own norm).",
    "optimizer.refresh": "Fresh projections (False: those of step 0 for ever).",
    "optimizer.refresh_every": "Steps between projection draws when `refresh` is on.",
    "optimizer.momentum": "β₁ of a first moment kept in sketch coordinates and carried across projection "
                          "changes (0 = none, the paper's).",
    "optimizer.distribution": "Projection entries, one of {DISTRIBUTIONS} (method §2).",
    "optimizer.base_seed": "Base of every projection seed (method §2).",
    "optimizer.b2": "RowAdam's β₂ (method §4).",
    "optimizer.eps": "RowAdam's ε: relative for `paper`, absolute for `nemo`.",
    "optimizer.round_bf16": "Round the merged factor to bf16, the wire format (None: the variant's convention, "
                            "bf16 for paper/sgd and fp32 for nemo).",
    "optimizer.sketch_native": "Sketch in the backward pass, never forming a dense target gradient (method §3); "
                               "False sketches the dense gradient.",
    "optimizer.non_targets": "What trains the parameters LoGRA does not target, one of {NON_TARGET_CHOICES}.",
    "optimizer.kl_control": "Size each step to a predicted-KL budget (method §5).",
    "optimizer.kl_budget": "KL budget at update 0.",
    "optimizer.kl_budget_final": "KL budget from update `kl_schedule_steps − 1` on (cosine in between).",
    "optimizer.kl_schedule_steps": "Length of the cosine budget schedule, in updates.",
    "optimizer.alpha_max": "Largest step scale α (a step may grow as well as shrink).",
    "optimizer.subtract_mismatch": "Subtract the EMA of the rollout-vs-trainer log-prob gap from the budget, "
                                   "never below half of it.",
    "optimizer.probe_responses": "Responses per step in the KL probe, spread over distinct prompts.",
    "optimizer.kl_undo_above": "Undo a step whose realised KL on the probe exceeds this multiple of the budget "
                               "(0 = off).",
    "optimizer.implementation": "Kernels of the sketched projection, RowAdam and the merge, one of "
                                "{IMPLEMENTATIONS}.",
    "optimizer.interpret": "Run the Pallas kernels in the Pallas interpreter (CPU tests).",
    "train.steps": "RL updates in the run (raise it to train a finished run longer).",
    "train.microbatches": "Gradient-accumulation microbatches per update (must divide the responses per step); "
                          "the loss is normalised once over all of them.",
    "train.seed": "Run seed (sampling, probe selection, data order).",
    "train.eval_every": "Held-out evaluation period in updates (0 = only before and after).",
    "train.checkpoint_every": "Checkpoint period in updates (0 = never).",
    "train.keep_checkpoints": "Checkpoints kept.",
    "train.log_every": "Metrics logging period in updates.",
    "train.mesh_data": "Data-parallel axis of the device mesh (-1: all the devices the other two leave; at most "
                       "one axis may be -1).",
    "train.mesh_fsdp": "FSDP axis of the device mesh: parameters and optimizer state sharded by rows (-1: all the "
                       "devices the other two leave).",
    "train.mesh_tensor": "Tensor-parallel axis of the device mesh (-1: all the devices the other two leave).",
    "train.resume_step": "Checkpoint to resume from (-1 = the newest; newer ones are moved aside, not deleted).",
    "train.resume_fallback": "When the newest checkpoint cannot be read, move it aside loudly and try the next "
                             "older one.",
}


def _run_config() -> types.ModuleType:
    return importlib.import_module("logra_jax.job.run_config")


def _registries(module: types.ModuleType) -> dict[str, str]:
    """{NAME: "`a`, `b`"} for every registry in run_config's namespace (an upper-case tuple of names, or a dict
    keyed by name such as ESTIMATORS), and the model presets."""
    out = {}
    namespace = {**vars(module), "PRESETS": importlib.import_module("logra_jax.models.config").PRESETS}
    for name, value in namespace.items():
        if name.isupper() and isinstance(value, tuple | dict) and value and all(isinstance(v, str) for v in value):
            out[name] = ", ".join(f"`{v}`" for v in value)
    return out


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return re.sub(r"\b(typing|collections\.abc)\.", "", str(hint))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def sections() -> list[tuple[str, type]]:
    """(section name, section dataclass) of RunConfig, in order."""
    rc = _run_config()
    return [(f.name, type(_default(f))) for f in dataclasses.fields(rc.RunConfig)]


def _docstring_clause(cls: type, name: str) -> str | None:
    """The clause (between ';' / sentence ends) of the class docstring that names `name`, if any."""
    text = " ".join((cls.__doc__ or "").split())
    for clause in re.split(r";\s+|(?<=\.)\s+(?=[A-Z])", text):
        if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", clause):
            return clause.strip().rstrip(".") + "."
    return None


def fields() -> list[dict[str, str]]:
    """Every RunConfig field: {key, section, name, type, default, meaning ('' when it has none)}."""
    rc = _run_config()
    registries = _registries(rc)
    out = []
    for section, cls in sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            meaning = FIELD_MEANINGS.get(key)
            if meaning is not None:
                meaning = re.sub(r"\{([A-Z_]+)\}", lambda m: registries[m.group(1)], meaning)
            else:
                meaning = _docstring_clause(cls, f.name) or ""
            default = _default(f)
            out.append({"key": key, "section": section, "name": f.name, "type": _type_name(hints[f.name]),
                        "default": repr(dict(default) if isinstance(default, typing.Mapping) else default),
                        "meaning": meaning})
    return out


def missing_meanings() -> tuple[list[str], list[str]]:
    """(fields with no meaning, FIELD_MEANINGS entries naming no field)."""
    table = fields()
    keys = {row["key"] for row in table}
    return [row["key"] for row in table if not row["meaning"]], sorted(set(FIELD_MEANINGS) - keys)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """The reference page's generated part: one table per section."""
    missing, stale = missing_meanings()
    if missing or stale:
        raise ValueError(f"config reference: fields without a meaning {missing} (add them to FIELD_MEANINGS in "
                         f"docs/_ext/config_reference.py or name them in the section's docstring); entries for "
                         f"no field {stale}")
    rows = fields()
    lines = []
    for section, cls in sections():
        lines += [f"## `{section}`", "", f"`{cls.__name__}`: " + " ".join((cls.__doc__ or "").split()), "",
                  "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for row in rows:
            if row["section"] == section:
                lines.append(f"| `{row['key']}` | `{_cell(row['type'])}` | `{_cell(row['default'])}` | "
                             f"{_cell(row['meaning'])} |")
        lines.append("")
    return "\n".join(lines)


def _write(app: Sphinx) -> None:
    out = Path(app.srcdir) / "_generated" / "config_fields.md"
    out.parent.mkdir(exist_ok=True)
    text = reference_markdown()
    if not out.exists() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")


def setup(app: Sphinx) -> dict[str, bool]:
    app.connect("builder-inited", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
