"""Orthogonal matching pursuit over a shared basis (Goddard & Fernandes Neto, "Training-Free Tokenizer
Transplantation via Orthogonal Matching Pursuit", arXiv:2506.06607), batched over targets.

Each target is solved on its own (the batch only vectorizes), so how tokens are cut into batches changes no
selection and only the rounding of batched products. Pure torch, no randomness.

On CPU, one thread, float32, the pick is screened (:class:`Screen`): the scores are first estimated in bfloat16
(a quarter of the float32 product's time where the CPU multiplies bfloat16 natively), a rigorous bound on the
estimate's error leaves the few atoms that can still be the row's best, and only those are scored by the float32
product itself, on gathered rows and columns. An element of that product has the same bits whatever the other
rows and columns (MKL, one thread, at least 12 columns and 16 rows: checked by the tests), so every pick, and with
it every output byte, is the one the whole product gives; a step whose candidates are too many takes the whole
product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resumerge.machine.torch_import import torch

# Below this an atom's orthogonal part counts as this long (a repeated or dependent atom).
EPS = 1e-8
# Steps between re-orthonormalizations of the basis (classical Gram-Schmidt drifts on long runs).
REORTHONORMALIZE = 256


def batch_omp(targets: torch.Tensor, atoms: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, coefficients), each (B, k): for every row of ``targets`` (B, D), the ``k`` rows of ``atoms``
    (N, D) picked greedily by their absolute inner product with the residual (atoms not normalized; the first on
    ties), and the least-squares coefficients of the target on them. Works in float32 (float64 for float64
    targets). Raises ValueError when ``k`` exceeds N."""
    count, n = targets.shape[0], atoms.shape[0]
    if k > n:
        raise ValueError(f"-k {k} atoms cannot be chosen from {n} shared tokens")
    dtype = targets.dtype if targets.dtype in (torch.float32, torch.float64) else torch.float32
    t = targets.to(dtype)
    a = atoms.to(dtype)
    dim = t.shape[1]
    q = torch.zeros((count, dim, k), dtype=dtype, device=t.device)
    r = torch.zeros((count, k, k), dtype=dtype, device=t.device)
    picked = torch.zeros((count, k), dtype=torch.long, device=t.device)
    score = t.new_empty((count, n))
    screen = Screen.of(a, count) if screens(t, a, k) else None
    residual = t.clone()
    for step in range(k):
        best = next_atoms(residual, a, picked, step, score, screen)
        atom = a[best]
        if step == 0:
            r[:, 0, 0] = atom.norm(dim=1)
            q[:, :, 0] = atom / r[:, 0, 0].clamp(min=EPS).unsqueeze(1)
        else:
            basis = q[:, :, :step]
            along = torch.bmm(basis.transpose(1, 2), atom.unsqueeze(-1)).squeeze(-1)
            orth = atom - torch.bmm(basis, along.unsqueeze(-1)).squeeze(-1)
            length = orth.norm(dim=1).clamp(min=EPS)
            r[:, :step, step] = along
            r[:, step, step] = length
            q[:, :, step] = orth / length.unsqueeze(-1)
        if step > 0 and step % REORTHONORMALIZE == 0:
            q_new, r_new = torch.linalg.qr(q[:, :, :step + 1], mode="reduced")
            r[:, :step + 1, :step + 1] = torch.bmm(r_new, r[:, :step + 1, :step + 1])
            q[:, :, :step + 1] = q_new
        basis = q[:, :, :step + 1]
        residual = t - torch.bmm(basis, torch.bmm(basis.transpose(1, 2), t.unsqueeze(-1))).squeeze(-1)
    coeffs = torch.linalg.solve_triangular(r, torch.bmm(q.transpose(1, 2), t.unsqueeze(-1)), upper=True).squeeze(-1)
    return picked, coeffs


def next_atoms(residual: torch.Tensor, atoms: torch.Tensor, picked: torch.Tensor, step: int,
               score: torch.Tensor, screen: Screen | None = None) -> torch.Tensor:
    """Each row's next atom (index into ``atoms``), written to ``picked[:, step]``: the one not among the row's
    ``picked[:, :step]`` with the largest absolute inner product with the row's ``residual`` (the first on ties).
    ``score`` is the (rows, atoms) workspace, reused across steps: a fresh one each step cost a fifth of the step
    again in page faults (the product itself is the same BLAS call, the same bits). The pursuit's pick, shared by
    ``omp`` and ``mp_rope``. ``screen``: :class:`Screen` the step first (the same picks)."""
    if screen is not None:
        screened = screen.pick(residual, atoms, picked, step)
        if screened is not None:
            picked[:, step] = screened
            return screened
    torch.mm(residual, atoms.T, out=score)
    score.abs_()
    if step:
        # The atoms already picked, out of the running: the same scores a (rows, atoms) mask would leave, in a
        # write of rows × step entries instead of a pass over the whole workspace.
        score.scatter_(1, picked[:, :step], -float("inf"))
    best = score.argmax(dim=1)
    picked[:, step] = best
    return best


# Unit roundoffs, each the bound of a truncation (twice round-to-nearest's), so that the bound holds however the
# bfloat16 product rounds: of a bfloat16 result (8 significant bits) and of float32 accumulation (24).
_BF16_ROUNDOFF = 2.0 ** -7
_F32_ROUNDOFF = 2.0 ** -23
# The error bound's margin over its terms (each computed in float32 itself) and its floor (flushed subnormals).
_SAFETY = 1.25
_FLOOR = 1e-30
# Rows of a float32 product on gathered columns (at least 16 rows: fewer, and MKL takes other kernels whose
# elements differ in their last bits), and the columns always gathered (at least 12, for the same reason).
_BLOCK_ROWS = 32
_MIN_COLUMNS = 16
# The screen's candidates may cost this share of the whole float32 product before the step takes the whole product.
_MAX_SHARE = 0.25
# The most of the atoms a block gathers (float32 copies) before the step takes the whole product.
_MAX_GATHERED = 1 / 8
# Atoms whose norms Screen.of takes at once.
_NORM_ROWS = 4096


def screens(targets: torch.Tensor, atoms: torch.Tensor, k: int) -> bool:
    """Whether :func:`batch_omp` screens its picks: float32 on CPU, one thread (a product split over threads may
    cut its sums by the product's shape), enough rows and atoms to gather, accumulation far below bfloat16's
    rounding, bfloat16 products that oneDNN computes natively, and the screen's bytes (a bfloat16 estimate and a
    byte per score, its candidates' indices, a bfloat16 copy of the atoms, a block's float32 copy of an eighth of
    them at most) within the part of the workspace ``held_bytes`` counts for a batch (``units._work``: three
    float32 scores and a byte per score, three float32 bases) that the pursuit leaves free (two scores, two bases),
    so the plan's bound holds."""
    rows, (n, width) = targets.shape[0], atoms.shape
    if targets.dtype != torch.float32 or atoms.device.type != "cpu" or torch.get_num_threads() != 1:
        return False
    if rows < _BLOCK_ROWS // 2 or n < 16 * _MIN_COLUMNS or width * _F32_ROUNDOFF > 1e-3:
        return False
    if rows * (4 * n + 8 * k * width) < 3 * n * width:
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    return gathers_exactly(width)


def gathers_exactly(width: int) -> bool:
    """Whether this machine's float32 product keeps what the screen rests on, probed at ``width``: an element of
    a product of gathered rows (a block's 16 to 32) and columns (16 or more) has the bits of the whole product's
    element. It holds for MKL on one thread where it was first measured, but it is the BLAS's kernel choice, not a
    contract, so each batch asks (a product of 128 rows and 512 atoms: about a millisecond) and takes the whole
    product where it fails: the picks are then the whole product's by construction."""
    g = torch.Generator().manual_seed(width)
    atoms, residual = torch.randn(512, width, generator=g), torch.randn(128, width, generator=g)
    whole = torch.mm(residual, atoms.T)
    # a block is 16 to 63 rows (a batch's rows cut in blocks of at least _BLOCK_ROWS): the largest is probed too
    for first, block in ((0, _BLOCK_ROWS // 2), (20, _BLOCK_ROWS - 1), (32, _BLOCK_ROWS), (40, 2 * _BLOCK_ROWS - 1)):
        for columns in (_MIN_COLUMNS, _MIN_COLUMNS + 25, 300):
            picked = torch.randperm(512, generator=g)[:columns].sort().values
            part = torch.mm(residual[first:first + block], atoms[picked].T)
            if not torch.equal(part, whole[first:first + block][:, picked]):
                return False
    return True


@dataclass(frozen=True)
class Screen:
    """A batch's bfloat16 copy of the atoms, its rounding and sizes, and the (rows, atoms) bfloat16 workspace.

    For a row r and atom a, with r~, a~ their bfloat16 roundings, the estimate s^ (the bfloat16 product, rounded
    to bfloat16) and the float32 score s (the whole product's element) differ by at most
    |r~||a - a~| + |r - r~||a~| + |r - r~||a - a~| + g(|r~||a~| + |r||a|) + u|s^|/(1 - u), g the accumulation's
    bound (K u32 / (1 - K u32), K the width) and u bfloat16's. With the atoms' largest norms in place of each
    atom's, that is beta + u'|s^| per row; an atom whose estimate is below the threshold cannot reach the row's
    largest estimate's lower bound, so cannot be the pick nor tie with it."""

    atoms: torch.Tensor
    rounding: float
    norm: float
    rounded_norm: float
    estimate: torch.Tensor

    @classmethod
    def of(cls, atoms: torch.Tensor, rows: int) -> Screen:
        low = atoms.to(torch.bfloat16)
        rounding = norm = rounded_norm = 0.0
        # The norms a slice at a time: float32 copies of all the atoms would outgrow the batch's workspace.
        for first in range(0, atoms.shape[0], _NORM_ROWS):
            exact, wide = atoms[first:first + _NORM_ROWS], low[first:first + _NORM_ROWS].float()
            rounding = max(rounding, float((exact - wide).norm(dim=1).max()))
            norm = max(norm, float(exact.norm(dim=1).max()))
            rounded_norm = max(rounded_norm, float(wide.norm(dim=1).max()))
        return cls(low, rounding, norm, rounded_norm, low.new_empty((rows, atoms.shape[0])))

    def pick(self, residual: torch.Tensor, atoms: torch.Tensor, picked: torch.Tensor,
             step: int) -> torch.Tensor | None:
        """Each row's next atom, as :func:`next_atoms` picks it; None where the candidates are too many."""
        count, n = self.estimate.shape
        width = atoms.shape[1]
        accumulated = width * _F32_ROUNDOFF / (1 - width * _F32_ROUNDOFF)
        rounded_out = _BF16_ROUNDOFF / (1 - _BF16_ROUNDOFF)
        low = residual.to(torch.bfloat16)
        wide = low.float()
        off = (residual - wide).norm(dim=1)
        low_norm, norm = wide.norm(dim=1), residual.norm(dim=1)
        beta = _SAFETY * (low_norm * self.rounding + off * self.rounded_norm + off * self.rounding
                          + accumulated * (low_norm * self.rounded_norm + norm * self.norm)) + _FLOOR
        estimate = self.estimate
        torch.mm(low, self.atoms.T, out=estimate)
        estimate.abs_()
        top = estimate.amax(dim=1)
        if step:
            # An atom already picked out of the running where it holds a row's largest estimate (rarely: its score
            # is the residual's rounding), so that the threshold follows the atoms still free.
            chosen = picked[:, :step]
            crowded = (estimate.gather(1, chosen) == top.unsqueeze(1)).any(dim=1).nonzero().squeeze(1)
            if crowded.numel():
                estimate[crowded.unsqueeze(1), chosen[crowded]] = 0
                top[crowded] = estimate[crowded].amax(dim=1)
        # The row's best score is at least top (1 - u') - beta; an atom's at most its estimate (1 + u') + beta.
        threshold = (top.float() * (1 - rounded_out) - 2 * beta) / (1 + rounded_out)
        if not bool(torch.isfinite(threshold).all()) or bool((threshold <= 0).any()):
            return None
        # Compared as bfloat16 bit patterns (int16, ordered as the values are, all of them positive), the threshold
        # rounded down to bfloat16 first (one pattern lower where rounding went up: a lower threshold only admits
        # more candidates).
        rounded = threshold.to(torch.bfloat16)
        floor = rounded.view(torch.int16) - (rounded.float() > threshold).to(torch.int16)
        rows, columns = (estimate.view(torch.int16) >= floor.unsqueeze(1)).nonzero(as_tuple=True)
        if columns.numel() * _BLOCK_ROWS > _MAX_SHARE * count * n:
            return None
        blocks = max(1, count // _BLOCK_ROWS)
        edges = [count * b // blocks for b in range(blocks + 1)]
        starts = torch.searchsorted(rows, torch.tensor(edges, dtype=rows.dtype, device=rows.device)).tolist()
        always = torch.arange(_MIN_COLUMNS, device=columns.device)
        gathered = []
        for b in range(blocks):
            gathered.append(torch.unique(torch.cat([columns[starts[b]:starts[b + 1]], always])))
        if sum((edges[b + 1] - edges[b]) * len(u) for b, u in enumerate(gathered)) > _MAX_SHARE * count * n \
                or max(len(u) for u in gathered) > n * _MAX_GATHERED:
            return None
        best = torch.empty(count, dtype=torch.long, device=residual.device)
        for b, union in enumerate(gathered):
            first, stop = edges[b], edges[b + 1]
            exact = torch.mm(residual[first:stop], atoms[union].T).abs_()
            if step:
                # The row's atoms already picked, wherever the gathered columns hold them, out of the running.
                chosen = picked[first:stop, :step].contiguous()
                where = torch.searchsorted(union, chosen).clamp_(max=len(union) - 1)
                held = union[where] == chosen
                out = torch.zeros((stop - first, len(union) + 1), dtype=torch.bool, device=exact.device)
                out.scatter_(1, torch.where(held, where, len(union)), True)
                exact.masked_fill_(out[:, :-1], -math.inf)
            best[first:stop] = union[exact.argmax(dim=1)]
        return best
