"""Parallelism: meshes and logical axis rules (`sharding`), the derivation of a state leaf's sharding from its
parameter's (`derived_specs`), and `jax.distributed` start-up across processes (`multihost`).

Above `core` and `kernels` (the train step's jit enters `kernels.backend.compiling_for`, which imports nothing).
"""
