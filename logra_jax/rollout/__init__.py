"""The rollout: sampling settings and draws (`sampling`), the continuous-batching decode engine in fixed slots
(`slots`), the engines behind one interface (`engine`: colocated in a decode layout, or a worker process), the
low-rank policy-sync payloads and their sending end (`sync`), and the worker process that receives them
(`worker`, `python -m logra_jax.rollout.worker`); the vLLM engine in its own subpackage (`vllm`).

Modules are imported directly (e.g. `from logra_jax.rollout.slots import Sampler`).
"""
