"""``iso_c`` and ``iso_cts``: Isotropic merging in the common subspace (Iso-C), the summed task vectors with a flat
spectrum, and in common and task-specific subspaces (Iso-CTS), that subspace completed by each model's own
directions.

Reference: Marczak et al., "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces",
ICML 2025, https://arxiv.org/abs/2502.04959; the authors' code is ``iso_c`` and ``iso_cts`` in
danielm1405/iso-merging (``src/utils/iso.py``).
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.spec import MergeContext, ParamSpec, Scope
from resumerge.merge.methods.spectral import (
    Components,
    as_matrix,
    base_f64,
    delta_sum,
    deltas,
    finish,
    frobenius,
    mean_path,
    rank,
    scaling,
    svd_method,
)


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


def split(k: int, tasks: int, fraction: float) -> tuple[int, int]:
    """(c, n) for a matrix of k singular values: c common directions and n task-specific ones per task, with
    c + T·n = k, as the authors' code sizes them: c₀ = ⌊k·f⌋, then the task-specific total rounded to a multiple of
    T with Python's round (half to even). Where that rounding would leave fewer than no common directions (only
    when c₀ < T/2) the total is rounded down instead."""
    common = int(k * fraction)
    specific = min(round((k - common) / tasks) * tasks, k // tasks * tasks)
    return k - specific, specific // tasks


def iso_common_specific(ctx: MergeContext) -> torch.Tensor:
    """Return B + α·σ̄·polar(U)·polar(Vᴴ) in float64, U and Vᴴ the common and task-specific singular vectors.

    For an m × n matrix with k = min(m, n), c and n as :func:`split` gives them from ``common_space_fraction``:
    the common subspace is the first c singular triplets of ΣΔᵢ (Δᵢ = θᵢ − B); each task vector, with its
    projection on the common left vectors removed (Δᵢ − U_c·(U_cᵀ·Δᵢ)), gives its first n triplets; U holds every
    task's left vectors then the common ones, Vᴴ their right vectors, and σ̄ is the mean of all k σ's kept. A
    fraction of 1 is Iso-C. Components with a singular value that is zero up to rounding give no vectors (their σ
    still counts in σ̄), so a tensor no model changed stays the base. Tensors that are not 2-D get
    B + α·mean(Δᵢ), as the authors' code averages them, and so do matrices with ``svd`` false (the planner's
    default for the token embedding and the head). Raises ``ValueError`` without a base.
    """
    base = base_f64(ctx)
    tasks = len(ctx.others())
    k = min(base.shape) if as_matrix(ctx) else 0
    if not k or not tasks:  # an empty matrix has no spectrum: the mean path returns it empty
        return mean_path(ctx, base)
    common, per_task = split(k, tasks, float(ctx.params["common_space_fraction"]))
    total = delta_sum(ctx, base)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    shared = min(common, rank(s, total.shape))
    del total
    basis = u[:, :shared].contiguous()
    sigma_sum = float(s[:common].sum())
    found = Components(base, k)
    if per_task:
        for delta in deltas(ctx, base):
            scale = frobenius(delta)
            residual = delta.sub_(basis @ (basis.T @ delta))
            ru, rs, rvh = torch.linalg.svd(residual, full_matrices=False)
            del residual, delta
            sigma_sum += float(rs[:per_task].sum())
            use = min(per_task, rank(rs, base.shape, scale))
            found.add(ru[:, :use], rs[:use], rvh[:use])
            del ru, rs, rvh
    found.add(basis, s[:shared], vh[:shared])
    del u, s, vh, basis
    return finish(found.orthogonalised(sigma_sum / k), base, scaling(ctx))


# Working memory (bytes per element) of each, as svd_method says.
SPEC_C = svd_method(
    "iso_c", "Iso-C (isotropic merging in the common subspace)",
    "the sum of the task vectors with its singular values all set to their mean (a flat spectrum), scaled and added "
    "to the base.",
    "https://arxiv.org/abs/2502.04959", iso_common,
    bound="SVD-bound (one SVD of each matrix, float64)",
    wide=(32, 0, 8, 0, None, (28, 0)), float64=(16, 0, 7.75, 0, None, (20, 0)),
)
SPEC_CTS = svd_method(
    "iso_cts", "Iso-CTS (isotropic merging in common and task-specific subspaces)",
    "the leading singular directions of the summed task vectors, completed by each model's own directions outside "
    "them, all with one flat singular value, scaled and added to the base.",
    "https://arxiv.org/abs/2502.04959", iso_common_specific,
    params=(ParamSpec("common_space_fraction", Scope.GLOBAL, float, default=0.8, minimum=0.0, maximum=1.0,
                      exclusive_min=True),),
    bound="SVD-bound (T + 3 SVDs of each matrix, float64)",
    wide=(32, 0, 31.5, 0, None, (24, 0)), float64=(16, 0, 31, 0, None, (15.5, 0)),
)
