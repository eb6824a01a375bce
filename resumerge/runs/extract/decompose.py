"""The decomposition math: a task vector ΔW (out × in) to LoRA factors B (out × r) and A (r × in) with B·A ≈ ΔW.

Two ways to the rank-r truncation of ΔW's singular value decomposition:

* :func:`exact_svd` — the exact rank-r truncation: mergekit-extract-lora's numbers (its full float32
  ``linalg.svd``, r components kept) up to each component's sign, which the SVD leaves free, and float32 rounding;
  computed from the float64 eigendecomposition of the smaller Gram matrix, three times faster than the full SVD.
* :func:`randomized_svd` — Halko, Martinsson and Tropp's range finder: ΔW times a seeded Gaussian sketch of
  2r columns (at least r + 8), ``power_iterations`` rounds of ΔWᵀ/ΔW products (each orthonormalised by a QR, so
  float32 keeps the small directions), then the exact SVD of the small projected matrix. O(m·n·(r+p)) work
  instead of O(m·n·min(m, n)); the default, chosen by measurement (see ``bench/bench_extract_lora.py`` and the
  tests): its ‖ΔW − BA‖_F is within 0.5 % of the exact truncation's on low-rank-plus-noise task vectors of real
  shapes. Deterministic for a seed (the sketch comes from a generator seeded per module).

Both return singular values in descending order; :func:`factors` turns them into (A, B) the way mergekit does:
√s on each side (``distribute_scale``), else s on A and B = U. A row or column of ΔW that is exactly zero (a
token the fine-tune never changed: its pad token's embedding row) is zero in the exact truncation too, but float32
leaves ~1e-8 there; :func:`changed_lines` and :func:`keep_unchanged` put the zeros back, so the adapter gives
BASE's weights there bit for bit. That matters where a model's forward starts from such a row: Gemma 4's pad
embedding is all zeros, so a leading pad's hidden state is exactly zero, and each RMSNorm (eps 1e-6) scales
a 1e-8 remainder by ~1000, 0.3 off the logits after four layers.

May import: torch only (pure functions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from resumerge.machine.torch_import import torch

# The sketch has r + max(8, r) columns and 5 power iterations. Measured (tests/extract/test_decompose.py and
# bench/bench_extract_lora.py) on low-rank-plus-noise task vectors where the noise tail dominates (the hard case
# for a range finder): r/4 extra columns and 3 iterations left errors up to 0.7 % above the exact truncation's;
# r extra and 3 iterations 0.3 %; r extra and 5 iterations 0.09 %, with a tenth of a full SVD's work at r = 32.
MIN_OVERSAMPLE = 8
POWER_ITERATIONS = 5
# Entries of a float64 column block of the exact truncation's Gram product (its float32 input is never copied
# whole into float64).
GRAM_BLOCK = 1 << 20


@dataclass(frozen=True)
class Truncation:
    """The first components of an SVD: ``u`` (m × k), ``s`` (k, descending), ``vh`` (k × n), float32."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor


def exact_svd(delta: torch.Tensor, rank: int) -> Truncation:
    """The exact rank-``rank`` truncation of ``delta`` (float32 results): the leading singular vectors of the
    shorter side from the eigendecomposition of the Gram matrix in float64, then the exact SVD of ``delta``
    projected on them (its singular values and the other side's vectors).

    The same truncation as keeping ``rank`` components of a full float32 ``torch.linalg.svd`` (mergekit's), up to
    each component's sign and float32 rounding: float64 holds the squared spectrum to about 1e-16 of its largest
    value, so the leading components come out more precisely than float32's own SVD gives them. A full SVD
    computes every component and both full orthogonal factors; this is about three times faster on one thread
    at the bench's 2048 × 5504 (measured: 26.7 s against 8.9 s on a loaded machine).
    """
    x = delta.to(torch.float32)
    tall = x.shape[0] > x.shape[1]
    a = x.T if tall else x  # k × l, k ≤ l: its Gram matrix a·aᵀ is the smaller one
    k, columns = a.shape
    step = max(1, GRAM_BLOCK // max(1, k))
    gram = torch.zeros((k, k), dtype=torch.float64, device=a.device)
    for first in range(0, columns, step):
        block = a[:, first : first + step].to(torch.float64)
        gram.addmm_(block, block.T)
        del block  # not held through the eigendecomposition
    _, vectors = torch.linalg.eigh(gram)  # ascending
    del gram
    keep = min(rank, k)
    q = vectors[:, k - keep :].flip(1).contiguous()
    del vectors
    small = torch.empty((keep, columns), dtype=torch.float64, device=a.device)
    for first in range(0, columns, step):
        small[:, first : first + step] = q.T @ a[:, first : first + step].to(torch.float64)
    ub, s, vh = torch.linalg.svd(small, full_matrices=False)
    u = (q @ ub).to(torch.float32)
    s, vh = s.to(torch.float32), vh.to(torch.float32)
    if tall:  # a = xᵀ = u·s·vh, so x = vhᵀ·s·uᵀ
        return Truncation(vh.T.contiguous(), s, u.T.contiguous())
    return Truncation(u, s, vh)


def gram_scratch(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """The exact truncation's bounded scratch on a matrix of ``shape`` (a footprint's scratch rule): its float64
    column block, and the Gram matrix with its eigenvectors and LAPACK's workspace, per entry of the Gram
    matrix (the shorter side squared)."""
    return min(math.prod(shape), GRAM_BLOCK), min(shape) ** 2


def sketch_width(rank: int, rows: int, cols: int) -> int:
    """Columns of the randomized sketch for ``rank`` components of a ``rows`` × ``cols`` matrix."""
    return min(rows, cols, rank + max(MIN_OVERSAMPLE, rank))


def full_svd(rank: int, rows: int, cols: int, *, exact: bool) -> bool:
    """Whether the rank-``rank`` truncation of a ``rows`` × ``cols`` matrix is found exactly (:func:`exact_svd`):
    when asked (``exact``), and when the randomized sketch would be half as wide as the matrix or more (nothing
    to gain)."""
    return exact or 2 * sketch_width(rank, rows, cols) >= min(rows, cols)


def randomized_svd(delta: torch.Tensor, rank: int, seed: int,
                   power_iterations: int = POWER_ITERATIONS) -> Truncation:
    """The rank-``rank`` truncation of ``delta`` by a randomized range finder seeded with ``seed`` (float32).

    Falls back to :func:`exact_svd` where :func:`full_svd` says so.
    """
    m, n = delta.shape
    width = sketch_width(rank, m, n)
    if full_svd(rank, m, n, exact=False):
        return exact_svd(delta, rank)
    x = delta.to(torch.float32)
    generator = torch.Generator(device=x.device).manual_seed(seed)
    omega = torch.randn((n, width), generator=generator, device=x.device, dtype=torch.float32)
    q, _ = torch.linalg.qr(x @ omega)
    for _ in range(power_iterations):
        z, _ = torch.linalg.qr(x.T @ q)
        q, _ = torch.linalg.qr(x @ z)
    small = q.T @ x  # width × n
    ub, s, vh = torch.linalg.svd(small, full_matrices=False)
    k = min(rank, s.shape[0])
    return Truncation(q @ ub[:, :k], s[:k], vh[:k])


def kept_rank(s: torch.Tensor, rank: int, sv_epsilon: float) -> int:
    """How many components to keep: at most ``rank``, and with ``sv_epsilon`` > 0 only those whose singular value
    is above it (mergekit's rule; may be 0)."""
    k = min(rank, s.shape[0])
    if sv_epsilon > 0:
        k = min(k, int((s > sv_epsilon).sum().item()))
    return k


def changed_lines(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows and which columns of ``delta`` hold an entry that is not zero (bool masks), read a block of rows
    at a time (one bool block of at most :data:`GRAM_BLOCK` entries, never a mask of the whole matrix)."""
    rows = torch.zeros(delta.shape[0], dtype=torch.bool, device=delta.device)
    columns = torch.zeros(delta.shape[1], dtype=torch.bool, device=delta.device)
    step = max(1, GRAM_BLOCK // max(1, delta.shape[1]))
    for first in range(0, delta.shape[0], step):
        nonzero = delta[first : first + step] != 0
        rows[first : first + step] = nonzero.any(1)
        columns |= nonzero.any(0)
    return rows, columns


def keep_unchanged(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> None:
    """Zero, in place, A's columns and B's rows where ΔW's (``changed_lines``) are all zero, so that B·A is
    exactly zero there as ΔW is."""
    a[:, ~columns] = 0
    b[~rows] = 0


def factors(t: Truncation, rank: int, distribute_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of the first ``rank`` components of ``t``, float32: A = √s·Vh and B = U·√s when
    ``distribute_scale``, else A = s·Vh and B = U."""
    s = t.s[:rank]
    if distribute_scale:
        root = torch.sqrt(s)
        return t.vh[:rank] * root[:, None], t.u[:, :rank] * root[None, :]
    return t.vh[:rank] * s[:, None], t.u[:, :rank].clone()


def truncate(delta: torch.Tensor, rank: int, *, exact: bool, seed: int) -> Truncation:
    """The rank-``rank`` truncation of ``delta`` (m × n): exact when ``exact``, else randomized."""
    return exact_svd(delta, rank) if exact else randomized_svd(delta, rank, seed)
