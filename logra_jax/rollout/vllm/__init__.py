"""The vLLM rollout engine: its JAX-side handle (`engine.VLLMEngine`), the settings the job passes to vLLM
(`settings.VLLMSettings`), the server process it starts in vLLM's own venv (`python -m
logra_jax.rollout.vllm.server`), the worker extension that merges low-rank payloads into vLLM's weights
(`extension`) and the PyTorch port of the projections it uses (`torch_projection`).

Only `engine` runs beside JAX; `settings` imports only the standard library, the other modules torch and vLLM and
no JAX, and this package imports nothing.
"""
