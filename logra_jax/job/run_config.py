"""The run configuration: frozen, validated dataclasses built from an ml_collections ConfigDict at load.

configs/*.py return ConfigDicts (the user edge); `RunConfig.from_dict` turns one into these dataclasses and
raises ValueError naming the field ("optimizer.rank") and the value on anything unknown, mistyped or out of
range, before any work starts. Library code below train.py only sees the dataclasses; the sections translate
themselves into the library's own settings (`rollout.sampling`, `algorithm.loss`, `algorithm.estimator_options`,
`train.mesh`, `task.spec`, `sft.spec`; the optimizer's in logra_jax.job.optimizer_plan).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from logra_jax.kernels.backend import IMPLEMENTATIONS
from logra_jax.optim.projection import DISTRIBUTIONS
from logra_jax.optim.row_adam import VARIANTS as ROW_ADAM_VARIANTS
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import parse_rank_rules
from logra_jax.optim.update_ratio import SCOPES
from logra_jax.parallel.sharding import MeshConfig
from logra_jax.rl.advantages import ESTIMATORS, WHITENINGS
from logra_jax.rl.losses import AGGREGATIONS, POLICIES, LossConfig
from logra_jax.rl.prompts import PROMPT_STYLES
from logra_jax.rl.tasks import GENERATED_KINDS, TaskSpec
from logra_jax.rollout.process import cpu_list
from logra_jax.rollout.sampling import SamplingConfig
from logra_jax.rollout.vllm.settings import VLLMSettings


def _fail(field: str, value: Any, why: str) -> None:
    raise ValueError(f"config.{field} = {value!r}: {why}")


def _check_choice(section: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(f"{section}.{name}", value, f"must be one of {list(choices)}")


def _check_range(section: str, name: str, value: float, lo: float | None = None, hi: float | None = None,
                 *, lo_open: bool = False, hi_open: bool = False) -> None:
    if not math.isfinite(value):
        _fail(f"{section}.{name}", value, "must be finite")
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(f"{section}.{name}", value, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        _fail(f"{section}.{name}", value, f"must be {'<' if hi_open else '<='} {hi}")


def _task_spec(section: str, **fields: Any) -> TaskSpec:
    """rl.tasks.TaskSpec(**fields), its ValueError reported as config.<section>.<field>."""
    try:
        return TaskSpec(**fields)
    except ValueError as e:
        field = re.match(r"TaskSpec\.(\w+)", str(e))
        name = field.group(1) if field else "kind"
        _fail(f"{section}.{name}", fields.get(name), str(e))


# The sketch settings' defaults are optim.SketchSpec's (OptimizerSection's rank, 64, is the runs' own default).
_SKETCH_SPEC = SketchSpec()
# The generator's settings and their defaults are rl.tasks.TaskSpec's: TaskSection takes them from it.
_TASK_SPEC = TaskSpec()
_GENERATOR_FIELDS = tuple(f.name for f in dataclasses.fields(TaskSpec))


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """preset: named ModelConfig; checkpoint: HF directory or GGUF file (overrides preset; "" = random init);
    overrides: ModelConfig fields to change (e.g. {"num_layers": 4, "dtype": "bfloat16"});
    tokenizer: "char" (synthetic tasks) or "checkpoint"; init_seed: random-init seed; expert_parallel: an MoE
    model's experts split over the fsdp mesh axis, each computed where it lives (logra_jax.models.expert_parallel;
    False: every expert's width over fsdp, gathered where the tokens are)."""

    preset: str = "tiny"
    checkpoint: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str = "char"
    init_seed: int = 0
    expert_parallel: bool = False

    def validate(self) -> None:
        from logra_jax.models.config import PRESETS, preset
        _check_choice("model", "preset", self.preset, tuple(PRESETS))
        _check_choice("model", "tokenizer", self.tokenizer, ("char", "checkpoint"))
        if self.tokenizer == "checkpoint" and not self.checkpoint:
            _fail("model.tokenizer", self.tokenizer, "needs model.checkpoint")
        if self.overrides.get("decode_unroll"):
            _fail("model.overrides", dict(self.overrides), "decode_unroll is the rollout engine's own layout (set "
                  "for GPUs by logra_jax.rollout.engine); the trained model keeps its layers stacked")
        if not self.checkpoint:
            try:
                config = preset(self.preset, **dict(self.overrides))
            except ValueError as err:
                _fail("model.overrides", dict(self.overrides), str(err))
            if self.expert_parallel and not config.moe:
                _fail("model.expert_parallel", self.expert_parallel, f"needs a mixture-of-experts model; preset "
                      f"{self.preset!r} has no experts")


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The RL task: kind "arithmetic" | "countdown" (generated: rl.tasks.TaskSpec's fields, with its defaults;
    for additions `carries`: "any" | "none" | "some") or "jsonl" (JSONL paths), sizes of the train and held-out
    splits, and the prompt style ("plain", "chat", or "compact": arithmetic as "12+7=" → "19")."""

    kind: str = _TASK_SPEC.kind
    difficulty: int = _TASK_SPEC.difficulty
    operations: str = _TASK_SPEC.operations
    count: int = _TASK_SPEC.count
    max_number: int = _TASK_SPEC.max_number
    max_target: int = _TASK_SPEC.max_target
    train_size: int = 4096
    eval_size: int = 128
    jsonl_train: str = ""
    jsonl_eval: str = ""
    seed: int = _TASK_SPEC.seed
    prompt_style: str = "plain"
    carries: str = _TASK_SPEC.carries

    def spec(self, seed: int | None = None) -> TaskSpec:
        """The generator of a generated task (kind "arithmetic" | "countdown") with `seed` (None: task.seed).

        Raises:
          ValueError: kind "jsonl", or a setting TaskSpec rejects (names config.task.<field>).
        """
        if self.kind == "jsonl":
            raise ValueError("config.task.kind = 'jsonl': a JSONL task has no generator spec")
        fields = {name: getattr(self, name) for name in _GENERATOR_FIELDS}
        return _task_spec("task", **{**fields, "seed": self.seed if seed is None else seed})

    def validate(self) -> None:
        _check_choice("task", "kind", self.kind, (*GENERATED_KINDS, "jsonl"))
        if self.kind != "jsonl":
            self.spec()
        _check_choice("task", "prompt_style", self.prompt_style, PROMPT_STYLES)
        if self.prompt_style == "compact" and self.kind != "arithmetic":
            _fail("task.prompt_style", self.prompt_style, "'compact' prompts exist for kind='arithmetic' only")
        _check_range("task", "train_size", self.train_size, 1)
        _check_range("task", "eval_size", self.eval_size, 1)
        _check_range("task", "seed", self.seed, 0)
        if self.kind == "jsonl" and not (self.jsonl_train and self.jsonl_eval):
            _fail("task.jsonl_train", self.jsonl_train, "kind='jsonl' needs task.jsonl_train and task.jsonl_eval")


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Optional supervised warm start: steps (0 = off), batch size and AdamW learning rate; the demonstrations
    are `train_size` easier arithmetic problems (difficulty, operations, carries as in rl.tasks.TaskSpec) plus
    `task_examples` problems of the RL task itself (generated tasks only). Held-out problems are never among
    them (see builders.build_tasks). cache_dir: when set, the warm-start weights are stored there keyed by
    everything they depend on (model, task, SFT settings, seed) and reused by later runs with the same key.
    max_final_loss: the run stops with `sft.WarmStartError` (naming the seed and the loss) when the warm start's
    final loss (the mean of its last 5% of steps) is above it, before any RL step; 0 = not checked."""

    steps: int = 0
    batch_size: int = 32
    learning_rate: float = 1e-3
    difficulty: int = 1
    operations: str = "+"
    train_size: int = 4096
    carries: str = "any"
    task_examples: int = 0
    cache_dir: str = ""
    max_final_loss: float = 0.0

    def spec(self, seed: int) -> TaskSpec:
        """The generator of the easier demonstrations (additions etc. of `difficulty`) with `seed`.

        Raises:
          ValueError: a setting TaskSpec rejects (names config.sft.<field>).
        """
        return _task_spec("sft", kind="arithmetic", seed=seed, difficulty=self.difficulty,
                          operations=self.operations, carries=self.carries)

    def validate(self) -> None:
        _check_range("sft", "steps", self.steps, 0)
        _check_range("sft", "batch_size", self.batch_size, 1)
        _check_range("sft", "learning_rate", self.learning_rate, 0.0, lo_open=True)
        self.spec(0)
        _check_range("sft", "train_size", self.train_size, 1)
        _check_range("sft", "task_examples", self.task_examples, 0)
        _check_range("sft", "max_final_loss", self.max_final_loss, 0.0)


# config.rollout.vllm_<field>: the fields of rollout.vllm.settings.VLLMSettings, with its defaults.
_VLLM = VLLMSettings()
_VLLM_FIELDS = tuple(f.name for f in dataclasses.fields(VLLMSettings))

# rollout.decode_layers → the colocated engine's `per_layer` (logra_jax.rollout.engine.DecodeLayout).
DECODE_LAYERS: dict[str, bool | None] = {"auto": None, "per_layer": True, "stacked": False}


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """prompts_per_step × num_samples responses per update, up to max_new_tokens each; sampling settings;
    workers: 0 = colocated rollout engine, 1 = a separate rollout worker process (low-rank policy sync);
    slots: rows decoded at once (continuous batching: a finished row's slot takes the next waiting row; the KV
    cache holds `slots` rows; 0 = every row at once; `python -m logra_jax.plan` says when the rollout needs fewer);
    decode_steps: decode steps between two refills; length_buckets: decode attends over the filled part of the
    cache in this many length steps; decode_tensor: t, the colocated engine's tensor-parallel group (its weights
    split over t devices, replicated over the n / t groups; 0 = chosen from the model and the devices);
    decode_layers: how the colocated engine holds the blocks' weights: "per_layer" (each layer's weights arrays of
    their own, read in place by XLA:GPU, which copies a stack's slices in every decode step: about half the decode
    time of "stacked" at 7B on one H100, on paper), "stacked" (the trainer's stacks, shared with the trainer where
    dtype and layout already match: no second copy of the weights, e.g. a bfloat16 job on one device) or "auto"
    (per_layer on GPUs, stacked elsewhere).
    engine: "jax" (ours, colocated or a worker process by `workers`) or "vllm" (vLLM in its own process from the
    venv of `make venv-vllm`, fed by low-rank sync); vllm_<field>: what the job passes to vLLM, the fields of
    `logra_jax.rollout.vllm.settings.VLLMSettings` (its interpreter, tensor parallel size, GPU memory fraction, dtype,
    max sequences at once, CPU KV-cache GiB, CUDA_VISIBLE_DEVICES); routing_replay: an MoE model's train step routes
    each token by the experts the engine chose for it (recorded by the JAX engine with every MoE rollout), the
    router still weighing them (`logra_jax.models.moe.route`); not available with engine="vllm".
    engine_devices: the last k of the job's devices run our JAX engine in this process, on a mesh of their own,
    and the trainer's mesh takes the others (the policy sync moves the low-rank payload device to device); 0 = the
    colocated engine on every device. max_staleness: how many policy versions a batch may be behind the policy
    it trains (0 = today's loop: rollout, then training, in sequence); k ≥ 1 overlaps them: the engine generates
    the next k batches while the trainer trains (it needs an engine on devices of its own: engine_devices,
    workers=1 or engine="vllm"; single-process runs). max_stale_kl: a batch is admitted only while the KL the
    controller predicted for the updates since its policy version (their sum) is within this budget (0 = no
    bound; needs optimizer.kl_control); stale_action: what happens to a batch over it, "regenerate" (with the
    current policy) or "clip" (trained with its importance weights capped at stale_tis_cap, needs algorithm.tis_cap).
    engine_cpus: the CPUs the worker process of workers=1 runs on, as taskset's list ("1", "2-3"; "" = this
    process's): each side its own cores, to measure overlap on a small host. engine_restarts: how many times an
    engine process that dies (or fails a request) is restarted from the trainer's weights, the lost batches asked
    again (the synchronous loop's result unchanged), before the run stops naming the engine and its last output.
    """

    prompts_per_step: int = 16
    num_samples: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    workers: int = 0
    slots: int = 0
    decode_steps: int = 8
    length_buckets: int = 4
    decode_tensor: int = 0
    decode_layers: str = "auto"
    engine: str = "jax"
    vllm_python: str = _VLLM.python
    vllm_tensor_parallel: int = _VLLM.tensor_parallel
    vllm_memory_fraction: float = _VLLM.memory_fraction
    vllm_dtype: str = _VLLM.dtype
    vllm_max_seqs: int = _VLLM.max_seqs
    vllm_kv_cache_gib: int = _VLLM.kv_cache_gib
    vllm_devices: str = _VLLM.devices
    routing_replay: bool = False
    engine_devices: int = 0
    max_staleness: int = 0
    max_stale_kl: float = 0.0
    stale_action: str = "regenerate"
    stale_tis_cap: float = 1.0
    engine_cpus: str = ""
    engine_restarts: int = 3

    @property
    def per_layer(self) -> bool | None:
        """decode_layers as the engine's `per_layer` (None: the platform's choice)."""
        return DECODE_LAYERS[self.decode_layers]

    def sampling(self, eos_id: int, pad_id: int, *, greedy: bool = False) -> SamplingConfig:
        """The sampler's settings for a tokenizer's eos/pad ids; greedy: one temperature-0 response per prompt
        (evaluation)."""
        schedule = dict(slots=self.slots, decode_steps=self.decode_steps, length_buckets=self.length_buckets)
        if greedy:
            return SamplingConfig(max_new_tokens=self.max_new_tokens, eos_id=eos_id, pad_id=pad_id, num_samples=1,
                                  temperature=0.0, **schedule)
        return SamplingConfig(max_new_tokens=self.max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                              num_samples=self.num_samples, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, **schedule)

    def validate(self) -> None:
        _check_range("rollout", "prompts_per_step", self.prompts_per_step, 1)
        _check_range("rollout", "num_samples", self.num_samples, 1)
        _check_range("rollout", "max_new_tokens", self.max_new_tokens, 1)
        _check_range("rollout", "temperature", self.temperature, 0.0, lo_open=True)
        _check_range("rollout", "top_k", self.top_k, 0)
        _check_range("rollout", "top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_choice("rollout", "workers", self.workers, (0, 1))
        _check_range("rollout", "slots", self.slots, 0)
        _check_range("rollout", "decode_steps", self.decode_steps, 1)
        _check_range("rollout", "length_buckets", self.length_buckets, 1)
        _check_range("rollout", "decode_tensor", self.decode_tensor, 0)
        _check_choice("rollout", "decode_layers", self.decode_layers, tuple(DECODE_LAYERS))
        _check_choice("rollout", "engine", self.engine, ("jax", "vllm"))
        _check_choice("rollout", "routing_replay", self.routing_replay, (False, True))
        if self.routing_replay and self.engine == "vllm":
            _fail("rollout.routing_replay", self.routing_replay, "needs rollout.engine='jax' (the engine that "
                  "records each token's experts; the vLLM engine does not return them)")
        if self.engine == "vllm":
            if self.workers:
                _fail("rollout.workers", self.workers, "applies to rollout.engine='jax' (vLLM runs in its own "
                      "process already): leave it 0")
            self.vllm_settings()
        self._validate_async()

    def _validate_async(self) -> None:
        """The placement and staleness fields (engine_devices, max_staleness, max_stale_kl, stale_action)."""
        _check_range("rollout", "engine_devices", self.engine_devices, 0)
        _check_range("rollout", "max_staleness", self.max_staleness, 0)
        _check_range("rollout", "max_stale_kl", self.max_stale_kl, 0.0)
        _check_choice("rollout", "stale_action", self.stale_action, ("regenerate", "clip"))
        _check_range("rollout", "stale_tis_cap", self.stale_tis_cap, 0.0, lo_open=True)
        _check_range("rollout", "engine_restarts", self.engine_restarts, 0)
        if self.engine_devices and (self.engine != "jax" or self.workers):
            _fail("rollout.engine_devices", self.engine_devices, "places our JAX engine in this process on devices "
                  "of its own: it needs rollout.engine='jax' and rollout.workers=0")
        if self.max_staleness and not (self.engine_devices or self.workers or self.engine == "vllm"):
            _fail("rollout.max_staleness", self.max_staleness, "overlaps rollout and training, which needs the "
                  "engine on devices of its own: set rollout.engine_devices, rollout.workers=1 or "
                  "rollout.engine='vllm'")
        if self.engine_cpus:
            if not self.workers:
                _fail("rollout.engine_cpus", self.engine_cpus, "pins the worker process: it needs rollout.workers=1")
            try:
                cpu_list(self.engine_cpus)
            except ValueError as e:
                _fail("rollout.engine_cpus", self.engine_cpus, str(e))
        if self.max_stale_kl and not self.max_staleness:
            _fail("rollout.max_stale_kl", self.max_stale_kl, "bounds the staleness of pipelined batches: it needs "
                  "rollout.max_staleness >= 1")

    def vllm_settings(self) -> VLLMSettings:
        """The vLLM engine's settings from the vllm_<field> fields.

        Raises:
          ValueError: a vllm_* field VLLMSettings rejects (named config.rollout.vllm_<field>).
        """
        return VLLMSettings(**{name: getattr(self, f"vllm_{name}") for name in _VLLM_FIELDS})


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """Advantage estimator (registry name) and policy loss; reward values (paper: 1 / −0.01). whiten: how
    reinforce++ whitens its advantages, "response" (every response counts once) or "token" (verl's: weighted
    by response length)."""

    estimator: str = "grpo"
    baseline_momentum: float = 0.1
    whiten: str = "response"
    policy: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0
    aggregation: str = "token_mean"
    kl_beta: float = 0.0
    reward_correct: float = 1.0
    reward_incorrect: float = -0.01
    format_weight: float = 0.0
    dynamic_sampling: bool = False

    def loss(self, max_len: int) -> LossConfig:
        """The policy loss settings (tis_cap 0 = off); max_len: the response budget T_max."""
        return LossConfig(policy=self.policy, eps_low=self.eps_low, eps_high=self.eps_high,
                          tis_cap=self.tis_cap or None, kl_beta=self.kl_beta, aggregation=self.aggregation,
                          max_len=max_len)

    def estimator_options(self) -> dict[str, Any]:
        """Keyword options of `rl.advantages.advantage_estimator` for this estimator."""
        return {"reinforce": {"momentum": self.baseline_momentum},
                "reinforce++": {"whiten": self.whiten}}.get(self.estimator, {})

    def validate(self) -> None:
        _check_choice("algorithm", "estimator", self.estimator, tuple(ESTIMATORS))
        _check_choice("algorithm", "whiten", self.whiten, WHITENINGS)
        if self.whiten != "response" and self.estimator != "reinforce++":
            _fail("algorithm.whiten", self.whiten, "is a reinforce++ option (algorithm.estimator='reinforce++')")
        _check_choice("algorithm", "policy", self.policy, POLICIES)
        _check_choice("algorithm", "aggregation", self.aggregation, AGGREGATIONS)
        _check_range("algorithm", "baseline_momentum", self.baseline_momentum, 0.0, 1.0, lo_open=True)
        _check_range("algorithm", "eps_low", self.eps_low, 0.0, 1.0, lo_open=True)
        _check_range("algorithm", "eps_high", self.eps_high, 0.0, lo_open=True)
        _check_range("algorithm", "tis_cap", self.tis_cap, 0.0)
        _check_range("algorithm", "kl_beta", self.kl_beta, 0.0)


# The optimizers `logra_jax.job.optimizer_plan.build_optimizer` builds from this section, and what LoGRA does with the
# parameters it does not target: the config's own vocabulary (no module below owns these names).
OPTIMIZER_NAMES = ("logra", "adamw", "galore", "adafactor", "row_adam")
NON_TARGET_CHOICES = ("frozen", "adamw", "router")
WEIGHT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """name: "logra" | "adamw" | "galore" | "adafactor" | "row_adam". AdamW/GaLore use learning_rate, weight_decay
    and grad_clip (0 = off), AdamW also adam_b1 (its β₁; 0 drops the first moment, as RowAdam has none),
    Adafactor learning_rate; AdamW with targets_only trains exactly LoGRA's targets (the rest frozen);
    row_adam is LoGRA's RowAdam and update_ratio on the targets' dense gradients (no sketch; b2, eps);
    GaLore also rank. LoGRA: rank, rank_rules (per-target ranks: "pattern=rank, pattern=rank, ...", each
    pattern a regex searched in a target's parameter path, e.g. "mlp=8" for the MoE experts'
    "blocks.mlp.gate_proj.kernel"; the first matching rule gives the target its rank, the others take rank;
    "" = none; every rule must give some target its rank and every rank must fit its target's width, checked
    against the model when the optimizer is built), variant, update_ratio (paper/sgd) and ratio_scope ("global"
    as in the paper, or "layer": each layer moves by update_ratio of its own norm), learning_rate (nemo), refresh and
    refresh_every (new projections every κ steps; refresh=False holds those of step 0 for ever), momentum (β₁ of
    the first moment kept in sketch coordinates and carried across projection changes; 0 = none, the paper's),
    distribution, base_seed, b2, eps, round_bf16 (None: the variant's convention, bf16 for paper/sgd and fp32 for
    nemo), sketch_native, non_targets ("frozen" | "adamw" | "router": AdamW on the MoE routers alone, the
    rest frozen), and the
    predicted-KL controller (kl_control, kl_budget → kl_budget_final over kl_schedule_steps, alpha_max,
    subtract_mismatch, probe_responses per step, kl_undo_above: undo a step whose realised KL on the probe
    exceeds this multiple of the budget; 0 = off). implementation: "xla" or "pallas" kernels for the sketched
    projection, RowAdam and the merge (interpret: run Pallas in interpret mode, for CPU tests). weight_dtype:
    how the weights are stored during RL, "float32" (the paper's) or "bfloat16" (LoGRA only, non-targets
    frozen): every matrix (kernels, embeddings) is stored in bfloat16 from the trainer's init on, and each
    low-rank merge rounds the float32 sum stochastically, keyed by seed, step and path, so the rollout engine
    applying the same update gets the same bits (logra_jax.optim.lowrank.stochastic_round_bf16)."""

    name: str = "logra"
    targets_only: bool = False
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    adam_b1: float = 0.9
    rank: int = 64
    rank_rules: str = ""
    variant: str = "paper"
    update_ratio: float = 6e-5
    ratio_scope: str = "global"
    refresh: bool = _SKETCH_SPEC.refresh
    refresh_every: int = _SKETCH_SPEC.refresh_every
    momentum: float = 0.0
    distribution: str = _SKETCH_SPEC.distribution
    base_seed: int = _SKETCH_SPEC.base_seed
    b2: float = 0.95
    eps: float = 1e-8
    round_bf16: bool | None = None
    sketch_native: bool = True
    non_targets: str = "frozen"
    kl_control: bool = False
    kl_budget: float = 2e-4
    kl_budget_final: float = 2e-5
    kl_schedule_steps: int = 300
    alpha_max: float = 3.0
    subtract_mismatch: bool = False
    probe_responses: int = 2
    kl_undo_above: float = 0.0
    implementation: str = _SKETCH_SPEC.implementation
    interpret: bool = _SKETCH_SPEC.interpret
    weight_dtype: str = "float32"

    def validate(self) -> None:
        _check_choice("optimizer", "name", self.name, OPTIMIZER_NAMES)
        _check_choice("optimizer", "weight_dtype", self.weight_dtype, WEIGHT_DTYPES)
        if self.weight_dtype != "float32" and (self.name != "logra" or self.non_targets != "frozen"):
            _fail("optimizer.weight_dtype", self.weight_dtype, "bfloat16 weights need optimizer.name='logra' with "
                  "non_targets='frozen': only LoGRA's merge rounds stochastically (a dense optax update would "
                  "round to nearest and lose every step below bfloat16's spacing)")
        if self.targets_only and self.name != "adamw":
            _fail("optimizer.targets_only", self.targets_only, "is an AdamW option (optimizer.name='adamw')")
        _check_choice("optimizer", "implementation", self.implementation, IMPLEMENTATIONS)
        _check_choice("optimizer", "variant", self.variant, ROW_ADAM_VARIANTS)
        _check_choice("optimizer", "ratio_scope", self.ratio_scope, SCOPES)
        _check_choice("optimizer", "distribution", self.distribution, DISTRIBUTIONS)
        _check_choice("optimizer", "non_targets", self.non_targets, NON_TARGET_CHOICES)
        _check_range("optimizer", "learning_rate", self.learning_rate, 0.0, lo_open=True)
        _check_range("optimizer", "weight_decay", self.weight_decay, 0.0)
        _check_range("optimizer", "grad_clip", self.grad_clip, 0.0)
        _check_range("optimizer", "adam_b1", self.adam_b1, 0.0, 1.0, hi_open=True)
        _check_range("optimizer", "rank", self.rank, 1)
        try:
            parse_rank_rules(self.rank_rules)
        except ValueError as e:
            _fail("optimizer.rank_rules", self.rank_rules, str(e))
        if self.rank_rules.strip() and self.name != "logra":
            _fail("optimizer.rank_rules", self.rank_rules, "per-target ranks are LoGRA's (optimizer.name='logra')")
        _check_range("optimizer", "update_ratio", self.update_ratio, 0.0, lo_open=True)
        _check_range("optimizer", "base_seed", self.base_seed, 0)
        _check_range("optimizer", "b2", self.b2, 0.0, 1.0, lo_open=True, hi_open=True)
        _check_range("optimizer", "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        if self.momentum and self.name != "logra":
            _fail("optimizer.momentum", self.momentum, "the sketch-space momentum needs optimizer.name='logra' "
                  "(AdamW's β₁ is optimizer.adam_b1)")
        if isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int):
            _fail("optimizer.refresh_every", self.refresh_every, "must be an int (steps between projection draws)")
        _check_range("optimizer", "refresh_every", self.refresh_every, 1)
        if self.refresh_every != 1 and not self.refresh:
            _fail("optimizer.refresh_every", self.refresh_every, "has no effect with optimizer.refresh=False "
                  "(a fixed projection); leave it at 1")
        _check_range("optimizer", "eps", self.eps, 0.0, lo_open=True)
        _check_range("optimizer", "kl_budget", self.kl_budget, 0.0, lo_open=True)
        _check_range("optimizer", "kl_budget_final", self.kl_budget_final, 0.0, lo_open=True)
        _check_range("optimizer", "kl_schedule_steps", self.kl_schedule_steps, 1)
        _check_range("optimizer", "alpha_max", self.alpha_max, 0.0, lo_open=True)
        _check_range("optimizer", "probe_responses", self.probe_responses, 1)
        _check_range("optimizer", "kl_undo_above", self.kl_undo_above, 0.0)
        if self.kl_undo_above and not self.kl_control:
            _fail("optimizer.kl_undo_above", self.kl_undo_above, "needs optimizer.kl_control=True")
        if self.kl_control and self.name != "logra":
            _fail("optimizer.kl_control", self.kl_control, "predicted-KL control needs optimizer.name='logra'")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """steps of RL updates, gradient-accumulation microbatches, seed, evaluation / checkpoint / log periods
    (0 = never), checkpoints kept, and the device mesh (data × fsdp × tensor); one of the three may be -1, "all
    the devices the others leave" (the default: fsdp over every device; 1×1×1 = one device). Resuming:
    resume_step picks the checkpoint (-1 = the newest; newer ones are moved aside, not deleted); with
    resume_fallback an unreadable newest checkpoint is moved aside, loudly, and the next older one is tried."""

    steps: int = 100
    microbatches: int = 1
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    log_every: int = 1
    mesh_data: int = 1
    mesh_fsdp: int = -1
    mesh_tensor: int = 1
    resume_step: int = -1
    resume_fallback: bool = False

    def mesh(self) -> MeshConfig:
        """The (data, fsdp, tensor) mesh shape."""
        return MeshConfig(self.mesh_data, self.mesh_fsdp, self.mesh_tensor)

    def validate(self) -> None:
        _check_range("train", "steps", self.steps, 1)
        _check_range("train", "resume_step", self.resume_step, -1)
        _check_range("train", "microbatches", self.microbatches, 1)
        _check_range("train", "seed", self.seed, 0)
        for name in ("eval_every", "checkpoint_every"):
            _check_range("train", name, getattr(self, name), 0)
        _check_range("train", "keep_checkpoints", self.keep_checkpoints, 1)
        _check_range("train", "log_every", self.log_every, 1)
        for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
            if getattr(self, name) != -1:
                _check_range("train", name, getattr(self, name), 1)
        if [self.mesh_data, self.mesh_fsdp, self.mesh_tensor].count(-1) > 1:
            _fail("train.mesh_fsdp", self.mesh_fsdp, "at most one of train.mesh_data / mesh_fsdp / mesh_tensor may "
                  f"be -1 (all remaining devices), got {self.mesh_data} × {self.mesh_fsdp} × {self.mesh_tensor}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; see the section classes for the fields."""

    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    sft: SFTSection = SFTSection()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerSection = OptimizerSection()
    train: TrainSection = TrainSection()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        batch = self.rollout.prompts_per_step * self.rollout.num_samples
        if batch % self.train.microbatches:
            _fail("train.microbatches", self.train.microbatches,
                  f"must divide rollout.prompts_per_step × rollout.num_samples = {batch}")
        if self.algorithm.estimator in ("grpo", "dr_grpo", "rloo") and self.rollout.num_samples < 2:
            _fail("rollout.num_samples", self.rollout.num_samples,
                  f"algorithm.estimator={self.algorithm.estimator!r} needs groups of at least 2 samples")
        if self.sft.task_examples and self.task.kind == "jsonl":
            _fail("sft.task_examples", self.sft.task_examples, "needs a generated task (task.kind 'arithmetic' or "
                                                               "'countdown'), got task.kind='jsonl'")
        if self.rollout.max_stale_kl and not self.optimizer.kl_control:
            _fail("rollout.max_stale_kl", self.rollout.max_stale_kl, "sums the KL the controller predicts for each "
                  "update: it needs optimizer.kl_control=True")
        if self.rollout.stale_action == "clip" and self.rollout.max_stale_kl and not self.algorithm.tis_cap:
            _fail("rollout.stale_action", "clip", "caps the importance weights of a batch over the KL budget: it "
                  "needs algorithm.tis_cap > 0")
        if self.optimizer.kl_control and self.optimizer.probe_responses > batch:
            _fail("optimizer.probe_responses", self.optimizer.probe_responses,
                  f"exceeds the {batch} responses of a step")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RunConfig:
        """Build and validate from a (nested) mapping such as an ml_collections ConfigDict.

        Raises:
          ValueError: an unknown section or field, a value of the wrong type, or a value out of range; the
            message names the field ("optimizer.rank") and the value.
        """
        config = _to_dict(config)
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - set(sections))
        if unknown:
            raise ValueError(f"config: unknown section(s) {unknown}; known: {sorted(sections)}")
        built = {name: _build(f.default.__class__, config.get(name, {}), name) for name, f in sections.items()}
        run = cls(**built)
        run.validate()
        return run

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON-able) of every field."""
        out = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            out[f.name] = {g.name: (dict(v) if isinstance(v := getattr(section, g.name), Mapping) else v)
                           for g in dataclasses.fields(section)}
        return out


def _to_dict(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: _to_dict(v) for k, v in value.items()}
    return value


def _build(section_cls: type, values: Mapping[str, Any], section: str) -> Any:
    if not isinstance(values, Mapping):
        _fail(section, values, "must be a mapping of fields")
    hints = typing.get_type_hints(section_cls)
    fields = {f.name for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"config.{section}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        want = hints[name]
        if typing.get_origin(want) in (typing.Union, types.UnionType):  # `X | None`: None, or a value of X
            if value is None:
                kwargs[name] = None
                continue
            (want,) = (arg for arg in typing.get_args(want) if arg is not type(None))
        origin = typing.get_origin(want) or want
        if origin in (Mapping, dict) or (isinstance(origin, type) and issubclass(origin, Mapping)):
            if not isinstance(value, Mapping):
                _fail(f"{section}.{name}", value, "must be a mapping")
            kwargs[name] = types.MappingProxyType(dict(value))
            continue
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is bool and not isinstance(value, bool):
            _fail(f"{section}.{name}", value, "must be a bool")
        if want is int and (isinstance(value, bool) or not isinstance(value, int)):
            _fail(f"{section}.{name}", value, "must be an integer")
        if want in (float, str) and not isinstance(value, want):
            _fail(f"{section}.{name}", value, f"must be a {want.__name__}")
        kwargs[name] = value
    return section_cls(**kwargs)


def check_variant(config_file: str, arg: str, variants: tuple[str, ...]) -> str:
    """`arg`, the variant in `--config=<config_file>:<arg>`, if it is one of the config's `variants` ("" = none).

    Raises:
      ValueError: an unknown variant, naming the config file, the variant given and the valid ones.
    """
    if arg not in variants:
        raise ValueError(f"{config_file}: unknown variant {arg!r}; valid variants: {list(variants)}")
    return arg
