"""``tsv``: Task Singular Vectors merging (TSV-M), each task vector's top singular components, decorrelated.

Reference: Gargiulo et al., "Task Singular Vectors: Reducing Task Interference in Model Merging", CVPR 2025,
https://arxiv.org/abs/2412.00081; the authors' code is ``compute_and_sum_svd_mem_reduction`` in
AntoAndGar/task_singular_vectors (``src/utils/TSVM_utils.py``). mergekit PR #639 names it ``tsvm``.
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.spec import MergeContext
from resumerge.merge.methods.spectral import (
    Components,
    as_matrix,
    base_f64,
    deltas,
    finish,
    mean_path,
    rank,
    scaling,
    svd_method,
)


def task_singular_vectors(ctx: MergeContext) -> torch.Tensor:
    """Return B + α·Δ_M in float64, Δ_M = polar(U)·diag(σ)·polar(Vᴴ) of the T task vectors' leading triplets.

    For an m × n matrix with k = min(m, n) singular values, each task vector Δᵢ = θᵢ − B (config order) gives its
    first r = ⌊k·(1/T)⌋ singular triplets (the authors' float expression); their left vectors side by side make U
    (m × T·r), their singular values σ and their right vectors Vᴴ (T·r × n), task by task, unsorted; polar() is
    the orthogonal factor of a matrix's SVD (see :func:`resumerge.merge.methods.spectral.polar`). So Δ_M's singular
    values are exactly the kept σ's, and one task gives its whole task vector (r = k). Components with a singular value
    that is zero up to rounding are left out (they carry nothing, and LAPACK's vectors for them are arbitrary).
    Tensors that are not 2-D get B + α·mean(Δᵢ), as the authors' code averages them; so do matrices with ``svd``
    false (the planner's default for the token embedding and the head) and matrices with fewer singular values than
    tasks (r = 0: the authors' code keeps nothing of them, B). Raises ``ValueError`` without a base.
    """
    base = base_f64(ctx)
    tasks = len(ctx.others())
    kept = int(min(base.shape) * (1 / tasks)) if tasks and as_matrix(ctx) else 0
    if kept == 0:
        return mean_path(ctx, base)
    found = Components(base, tasks * kept)
    for delta in deltas(ctx, base):
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        use = min(kept, rank(s, delta.shape))
        del delta
        found.add(u[:, :use], s[:use], vh[:use])
        del u, s, vh
    return finish(found.orthogonalised(found.s), base, scaling(ctx))


# Working memory (bytes per element), as svd_method says.
_WIDE = (32, 0, 17, 0, None, (27.5, 0))
_FLOAT64 = (16, 0, 16.5, 0, None, (20, 0))

SPEC = svd_method(
    "tsv", "Task Singular Vectors (TSV-M)",
    "each model's task vector cut to its leading singular components (1/T of them each), the components of all "
    "models decorrelated by orthogonalising their singular vectors, then added to the base.",
    "https://arxiv.org/abs/2412.00081", task_singular_vectors,
    bound="SVD-bound (T + 2 SVDs of each matrix, float64)", wide=_WIDE, float64=_FLOAT64,
)
