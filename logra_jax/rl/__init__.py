"""RL building blocks: sampler, tasks, answers, rewards, data, advantages, losses, chunked log-probs.

Modules are imported directly (e.g. `from logra_jax.rollout.sampling import Sampler`) so that importing one piece does
not pull in the others' dependencies (tensorflow-datasets and grain are only needed by `data`).
"""
