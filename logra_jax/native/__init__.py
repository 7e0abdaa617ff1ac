"""Sketch-native mode: the bridge between the model (logra_jax.models) and the optimizer (logra_jax.optim).

The optax transformations in logra_jax.optim know no model; this package is where a model meets them:
- `sketch_probes`: `attach_sketch_probes(model, spec)` (spec: the optimizer's `logra_jax.optim.SketchSpec`) gives
  every LoGRA target layer a probe whose gradient is its sketch S = G Aᵀ (no dense target gradient is ever
  formed), and `sketching(step)` switches the hooks on inside a traced step (`kind="tangent"` for the factored
  JVP δy = (X Aᵀ) Uᵀ).
- `kl_probe`: the predicted-KL probe of docs/method.md §5 (q of a proposed update on probe responses, through the
  tangent hooks) and the realised KL; `optim.predicted_kl.scale_by_predicted_kl` turns q into the step scale.
"""

from logra_jax.core.extras import requires_extra

with requires_extra("rl", "logra_jax.native"):
    from logra_jax.native.kl_probe import make_kl_probe, predicted_and_realised_kl, realised_kl
    from logra_jax.native.sketch_probes import SketchDigest, SketchProbe, attach_sketch_probes, sketching

__all__ = ["SketchDigest", "SketchProbe", "attach_sketch_probes", "make_kl_probe",
           "predicted_and_realised_kl", "realised_kl", "sketching"]
