"""Least squares whose bits are the same from one call to the next, for the approximations that fit coefficients
(``mp_rope``, ``stb``, ``common_interpolation``'s least-squares and barycentric weights).

``torch.linalg.lstsq``'s default CPU driver, LAPACK's ``gelsy``, is not a function of its inputs in torch (2.x up
to 2.13 at least): its pivot array ``jpvt`` is an input too (a nonzero entry fixes that column in front), and
torch allocates it uninitialized and reuses it across a batch's items without clearing it
(https://github.com/pytorch/pytorch/issues/187411). So a call's answer follows whatever the heap held before it (an
earlier allocation on any thread) and, within a batch, the previous item's pivots: other low bits on one thread as
on two, and on a rank-deficient system another rank altogether. A resumed transplant would then write other bytes
for the batches it computes again. mergekit-tokensurgeon 0.1.5 calls that driver, so its answers carry the same
noise; the definition both follow is lstsq's, which :func:`least_squares` computes from a singular value
decomposition instead (LAPACK's SVD routines keep no state between calls).
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch


def least_squares(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The x of least norm among those minimizing ‖a x − b‖, for ``a`` (..., m, n) and ``b`` (..., m, r) of one
    floating dtype, batched over the leading dimensions: ``torch.linalg.lstsq``'s definition and its default
    cutoff (a singular value at most eps · max(m, n) times the largest counts as zero, so a rank-deficient or
    underdetermined system gets its minimum-norm solution). On the CPU LAPACK's ``gelsd``, lstsq's
    divide-and-conquer SVD driver (a third less CPU than the SVD written out, on (512, 576, 64) batches);
    elsewhere :func:`pseudo_inverse_solve` (CUDA's lstsq has only ``gels``, which assumes full rank). Each item's
    answer is the same bits alone as in its batch."""
    if a.device.type == "cpu":
        solution: torch.Tensor = torch.linalg.lstsq(a, b, driver="gelsd").solution
        return solution
    return pseudo_inverse_solve(a, b)


def pseudo_inverse_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`least_squares` written out from ``torch.linalg.svd``: V diag(1/s) Uᵀ b, over the singular values
    above the cutoff (any device; the path off the CPU)."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    cutoff = s[..., :1] * (torch.finfo(s.dtype).eps * max(a.shape[-2], a.shape[-1]))
    kept = s > cutoff
    inverse = torch.where(kept, 1 / torch.where(kept, s, torch.ones_like(s)), torch.zeros_like(s))
    solution: torch.Tensor = vh.mT @ ((u.mT @ b) * inverse.unsqueeze(-1))
    return solution
