"""The bottom floor: helpers every layer may use, importing nothing of the project, no flax and no optax.

`tree_paths` (the one canonical parameter path, "blocks.attn.q_proj.kernel"), `fingerprint` (the one bit
fingerprint of arrays: checkpoints, sync, equal starts across processes), `giles` (Giles' erfinv coefficients,
shared by the JAX projections and their PyTorch port, so it imports nothing at all) and `extras` (optional
dependencies named by their pip extra).
"""
