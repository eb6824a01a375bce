"""Orthogonal matching pursuit over a shared basis (Goddard & Fernandes Neto, "Training-Free Tokenizer
Transplantation via Orthogonal Matching Pursuit", arXiv:2506.06607), batched over targets.

Each target is solved on its own (the batch only vectorizes), so how tokens are cut into batches changes no
selection and only the rounding of batched products. Pure torch, no randomness.
"""

from __future__ import annotations

from resumerge.torch_import import torch

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
    residual = t.clone()
    for step in range(k):
        best = next_atoms(residual, a, picked, step, score)
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
               score: torch.Tensor) -> torch.Tensor:
    """Each row's next atom (index into ``atoms``), written to ``picked[:, step]``: the one not among the row's
    ``picked[:, :step]`` with the largest absolute inner product with the row's ``residual`` (the first on ties).
    ``score`` is the (rows, atoms) workspace, reused across steps: a fresh one each step cost a fifth of the step
    again in page faults (the product itself is the same BLAS call, the same bits). The pursuit's pick, shared by
    ``omp`` and ``mp_rope``."""
    torch.mm(residual, atoms.T, out=score)
    score.abs_()
    if step:
        # The atoms already picked, out of the running: the same scores a (rows, atoms) mask would leave, in a
        # write of rows × step entries instead of a pass over the whole workspace.
        score.scatter_(1, picked[:, :step], -float("inf"))
    best = score.argmax(dim=1)
    picked[:, step] = best
    return best
