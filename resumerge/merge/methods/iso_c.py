"""``iso_c``: Isotropic merging in the common subspace (Iso-C), the summed task vectors with a flat spectrum.

Reference: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces",
ICML 2025, https://arxiv.org/abs/2502.04959; the authors' code is ``iso_c`` in danielm1405/iso-merging
(``src/utils/iso.py``).
"""

from __future__ import annotations

from resumerge.merge.methods.spec import MergeContext
from resumerge.merge.methods.spectral import (
    as_matrix,
    base_f64,
    delta_sum,
    finish,
    mean_path,
    rank,
    scaling,
    svd_method,
)
from resumerge.torch_import import torch


def iso_common(ctx: MergeContext) -> torch.Tensor:
    """Return B + α·σ̄·polar(ΣΔᵢ) in float64: the sum of the task vectors Δᵢ = θᵢ − B with every singular value
    replaced by their mean σ̄ over all k = min(m, n) of them (the nuclear norm over k).

    Directions where the sum is zero up to rounding get no weight (the authors' code gives them σ̄ along vectors
    LAPACK picks at will; see :mod:`resumerge.merge.methods.spectral`). Tensors that are not 2-D get B + α·mean(Δᵢ), as
    the authors' code averages them, and so do matrices with ``svd`` false (the planner's default for the token
    embedding and the head). Raises ``ValueError`` without a base.
    """
    base = base_f64(ctx)
    if not as_matrix(ctx):
        return mean_path(ctx, base)
    total = delta_sum(ctx, base)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    kept = rank(s, total.shape)
    mean = float(s.mean()) if s.numel() else 0.0
    del s
    left = u[:, :kept]
    del u
    merged = torch.matmul(left, vh[:kept], out=total)
    del left, vh
    return finish(merged.mul_(mean), base, scaling(ctx))


# Working memory (bytes per element), as svd_method says.
_WIDE = (32, 0, 8, 0, None, (28, 0))
_FLOAT64 = (16, 0, 7.75, 0, None, (20, 0))

SPEC = svd_method(
    "iso_c", "Iso-C (isotropic merging in the common subspace)",
    "the sum of the task vectors with its singular values all set to their mean (a flat spectrum), scaled and added "
    "to the base.",
    "https://arxiv.org/abs/2502.04959", iso_common,
    bound="SVD-bound (one SVD of each matrix, float64)", wide=_WIDE, float64=_FLOAT64,
)
