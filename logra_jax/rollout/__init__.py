"""The rollout: sampling settings and draws (`sampling`), the continuous-batching decode engine in fixed slots
(`slots`), the engines behind one interface (`engine.RolloutEngine`: colocated in a decode layout, or in a process
of their own), the low-rank policy-sync payloads and their sending end (`sync`), the bytes on the wire (`wire`),
both ends of an engine process (`process`: the trainer's handle, the engine's request loop), and our worker process
that receives the payloads (`worker`, `python -m logra_jax.rollout.worker`); the vLLM engine in its own
subpackage (`vllm`).

Modules are imported directly (e.g. `from logra_jax.rollout.slots import Sampler`).
"""
