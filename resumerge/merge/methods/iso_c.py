"""``iso_c``: Isotropic merging in the common subspace (Iso-C), the summed task vectors with a flat spectrum.

Reference: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces",
ICML 2025, https://arxiv.org/abs/2502.04959; the authors' code is ``iso_c`` in danielm1405/iso-merging
(``src/utils/iso.py``).
"""

from __future__ import annotations

from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, WholeCost
from resumerge.merge.methods.spectral import (
    SVD_PARAM,
    VOCAB_DEFAULTS,
    as_matrix,
    base_f64,
    delta_sum,
    finish,
    mean_path,
    rank,
    scaling,
    svd_scratch,
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


# Working memory measured by tests/methods/footprint_cases.py's profiler replay (torch 2.x CPU) on 24×24 to
# 2048×2048 weights: the mean path's float64 copies (fixed; a tensor of the other dtypes is widened), and for a
# matrix a phase of float64 buffers of its size plus the singular-vector panels and LAPACK's workspace, per
# element of k·(m + n) (spectral.svd_scratch). float32, bfloat16 and float16 measure alike.
_WIDE = (32, 0, 8, 0, None, (28, 0))
_FLOAT64 = (16, 0, 7.75, 0, None, (20, 0))

SPEC = MethodSpec(
    name="iso_c",
    title="Iso-C (isotropic merging in the common subspace)",
    summary=(
        "the sum of the task vectors with its singular values all set to their mean (a flat spectrum), scaled "
        "and added to the base."
    ),
    reference="https://arxiv.org/abs/2502.04959",
    fn=iso_common,
    params=(ParamSpec("scaling", Scope.GLOBAL, float, default=1.0), SVD_PARAM),
    vocab_defaults=VOCAB_DEFAULTS,
    base=BasePolicy.REQUIRED,
    min_inputs=2,
    # LAPACK's SVD splits its work by torch's thread count.
    thread_dependent=True,
    # Its time is that of one SVD of the matrix's size: plan times a call per shape.
    whole_cost=WholeCost(params=("svd",), bound="SVD-bound (one SVD of each matrix, float64)"),
    footprint=measured(_WIDE, _WIDE, _WIDE, _FLOAT64, scratch=svd_scratch, flat_unless="svd"),
)
