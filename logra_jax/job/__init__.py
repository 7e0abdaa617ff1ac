"""The RL job: validated config sections (`run_config`), the model, data (`builders`) and optimizer
(`optimizer_plan`) they build, the microbatched train step (`train_step`), the loop's phases (`phases`, `sft`) and
the loop itself (`train.train_and_evaluate`), checkpoints, stop/resume rules (`lifecycle`) and metrics.

The command line is `python -m logra_jax.main`.
"""
