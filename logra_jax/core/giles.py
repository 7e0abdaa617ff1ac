"""Giles' float32 erfinv ("Approximating the erfinv function", 2010), the coefficients only: p(w) in w − 2.5 for
w = −log1p(−x²) < 5 and in √w − 3 above, highest degree first, evaluated in Horner order. What XLA's decomposition
of `erf_inv` computed for `jax.random.normal` up to jax 0.10; the Gaussian projections use it on every version
(`logra_jax.optim.projection.giles_erfinv`) and so does their PyTorch port (`logra_jax.rollout.vllm.torch_projection`),
which runs where JAX is not installed: this module imports nothing.
"""

ERFINV_LT5 = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941)
ERFINV_GE5 = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682)
