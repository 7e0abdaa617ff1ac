"""The planner: compile-only devices of named chips (`aot`), every phase of the job compiled for them (`plan`),
per-device bytes of one step (`memory_analysis`) and flops and bytes with every loop iteration counted
(`hlo_cost`). Nothing here allocates or runs a model.

The command line is `python -m logra_jax.plan`.
"""
