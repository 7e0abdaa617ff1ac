"""LoGRA's memory-bound passes as Pallas kernels with XLA twins, selected by `implementation="xla" | "pallas"`.

- `sketched_linear` (project.py): y = x·K whose backward hands the sketch S = Hᵀ(X Aᵀ) to a probe.
- `merge` (merge.py): K ← K + Aᵀ Uᵀ block by block, in place under donation.
- `row_moment` (row_moment.py): RowAdam's row second moment and row scaling in one pass over S.
Those modules hold the TPU (Mosaic) kernels; `gpu.py` the NVIDIA GPU (Triton) versions of all three, which
`implementation="pallas"` picks on a GPU. `backend.py` holds what they share (implementation switch, platform
choice, block sizes, edge masks, TPU compiler params).
"""

from logra_jax.kernels.backend import IMPLEMENTATIONS, default_implementation
from logra_jax.kernels.merge import merge
from logra_jax.kernels.project import sketched_linear
from logra_jax.kernels.row_moment import row_moment

__all__ = ["IMPLEMENTATIONS", "default_implementation", "merge", "row_moment", "sketched_linear"]
