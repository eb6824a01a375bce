"""The rows of DONOR's tokens that MODEL lacks, one batch at a time: every approximation method of
mergekit-tokensurgeon 0.1.5 that resumerge computes, as pure functions of the batch's tensors and a generator.

Where 0.1.5 crashes or departs from the method's own definition, these follow the definition (each said in the
run's notes, :func:`method_notes`): ``common_interpolation`` of a half-precision DONOR measures and weighs in float32
(0.1.5 raises on the dtype mismatch); ``mean`` with noise adds it to each row's own copy (0.1.5 writes into an
expanded view and raises); ``john_hewitt`` falls back to N(0, 0.02²) rows when the covariance is not positive
definite (0.1.5 raises on ``len(int)``); ``landmark_pca`` takes exact principal components and the Procrustes
rotation that maps DONOR's landmarks onto MODEL's (0.1.5's randomized PCA moves with the torch seed and its
rotation is the transpose); ``stb`` is computed (0.1.5 always fails) with its basis combinations applied to centred
rows; ``mp_rope`` is 0.1.5's pursuit, its RoPE theta read from transformers 5 configs too. Least squares
(``mp_rope``, ``stb``, the barycentric and least-squares weights) take lstsq's minimum-norm solution through
:func:`~resumerge.runs.transplant.leastsq.least_squares`, the same bits on every call (0.1.5's solver is not).
Random draws (``randn``, ``john_hewitt``, noise) come from the generator the unit seeds
per batch, never torch's global one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from resumerge.machine.torch_import import torch
from resumerge.runs.transplant.leastsq import least_squares
from resumerge.runs.transplant.omp import batch_omp, next_atoms

# Distances and weight sums below this count as this (mergekit's clamps, so the weights are the same numbers).
_TINY = 1e-6
# The fallback spread of john_hewitt's rows when the covariance is not positive definite (mergekit's).
_HEWITT_FALLBACK = 0.02


@dataclass(frozen=True)
class Batch:
    """One batch's inputs: ``targets`` DONOR's rows of its tokens (no columns for a method that reads none);
    ``donor_shared``/``model_shared`` the two models' rows of the shared tokens (by DONOR id; MODEL's width and
    dtype are read from ``model_shared``, which has no rows for a method that reads none); ``stats`` MODEL's whole
    matrix summed up (mean, john_hewitt); ``piece_rows`` MODEL's rows that ``pieces`` (each token's subwords, by
    index into ``piece_rows``) name (subword); ``lm_head`` whether the matrix is the head."""

    targets: torch.Tensor
    donor_shared: torch.Tensor
    model_shared: torch.Tensor
    stats: ModelStats | None = None
    piece_rows: torch.Tensor | None = None
    pieces: tuple[tuple[int, ...], ...] = ()
    lm_head: bool = False


@dataclass(frozen=True)
class ModelStats:
    """MODEL's whole matrix summed up, from float64 sums over its row ranges (the same numbers whatever the ranges'
    size, to float64 rounding): the mean row, the biased covariance (``john_hewitt`` only) and the row count."""

    mean: torch.Tensor
    covariance: torch.Tensor | None
    rows: int


@dataclass(frozen=True)
class Method:
    """The approximation asked: mergekit's method name and its options."""

    name: str
    k: int = 64
    cosine: bool = False
    weight_scheme: str = "distance_proportional"
    subword: str = "mean"
    noise: float | None = None
    scale: float | None = None
    rope: tuple[Rope, Rope] | None = None  # mp_rope: (DONOR's, MODEL's)


@dataclass(frozen=True)
class Rope:
    """How a model's hidden vector is cut into rotary heads (mp_rope): ``heads`` × (width / heads), ``base`` its
    RoPE theta."""

    heads: int
    base: float = 10000.0


def approximate(method: Method, batch: Batch, generator: torch.Generator) -> torch.Tensor:
    """The batch's rows in MODEL's dtype, noise and scale applied (noise first, as 0.1.5)."""
    rows = _rows(method, batch, generator)
    if method.noise:
        noise = torch.randn(rows.shape, generator=generator, dtype=rows.dtype, device=rows.device)
        rows = rows + noise * method.noise
    if method.scale:
        rows = rows * method.scale
    return rows


def _rows(method: Method, b: Batch, generator: torch.Generator) -> torch.Tensor:
    count, width, dtype = b.targets.shape[0], b.model_shared.shape[1], b.model_shared.dtype
    device = b.model_shared.device
    if method.name == "zero":
        return torch.zeros((count, width), dtype=dtype, device=device)
    if method.name in ("mean", "john_hewitt"):
        if b.stats is None:
            raise ValueError(f"internal: {method.name} needs MODEL's statistics (Batch.stats)")
        if method.name == "mean":
            return b.stats.mean.to(dtype).unsqueeze(0).repeat(count, 1)
        return hewitt(b.stats, count, dtype, generator)
    if method.name == "randn":
        return torch.randn((count, width), generator=generator, dtype=dtype, device=device)
    if method.name == "subword":
        if b.piece_rows is None:
            raise ValueError("internal: subword needs MODEL's rows of the pieces (Batch.piece_rows)")
        return subword(b.piece_rows, b.pieces, method.subword, lm_head=b.lm_head)
    if method.name == "landmark_pca":
        return landmark_pca(b.targets, b.donor_shared, b.model_shared).to(dtype)
    if method.name == "stb":
        return token_basis(b.targets, b.donor_shared, b.model_shared, method.k).to(dtype)
    if method.name == "mp_rope":
        if method.rope is None:
            raise ValueError("internal: mp_rope needs both models' rotary heads (Method.rope)")
        return mp_rope(b.targets, b.donor_shared, b.model_shared, method.k, method.rope).to(dtype)
    if method.name == "omp":
        picked, weights = batch_omp(b.targets, b.donor_shared, method.k)
    elif method.name == "common_interpolation":
        picked, weights = interpolation(b.targets, b.donor_shared, method)
    else:
        raise ValueError(f"internal: unknown approximation method {method.name}")
    atoms = b.model_shared[picked].to(weights.dtype if weights.dtype == torch.float64 else torch.float32)
    return torch.bmm(weights.unsqueeze(1).to(atoms.dtype), atoms).squeeze(1).to(dtype)


def interpolation(targets: torch.Tensor, points: torch.Tensor, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) of each target's ``k`` nearest shared tokens (euclidean, or 1 − cosine) and their
    weights: inverse distance (1 − d for cosine) normalized, affine least squares (barycentric), or plain least
    squares. A half-precision DONOR is measured in float32."""
    if targets.dtype in (torch.float16, torch.bfloat16):
        targets, points = targets.float(), points.float()
    if method.cosine:
        norms = targets.norm(dim=1, keepdim=True) * points.norm(dim=1, keepdim=True).T
        distance = 1 - (targets @ points.T) / norms.clamp(min=_TINY)
    else:
        distance = torch.cdist(targets, points, p=2)
    _, picked = torch.topk(distance, k=method.k, dim=1, largest=False)
    near = distance.gather(1, picked)
    chosen = points[picked]
    if method.weight_scheme == "distance_proportional":
        weights = 1 - near if method.cosine else 1 / near.clamp(min=_TINY)
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=_TINY)
    elif method.weight_scheme == "barycentric":
        weights = _affine(targets, chosen)
    else:
        weights = least_squares(chosen.transpose(1, 2).float(), targets.unsqueeze(-1).float()).squeeze(-1)
    return picked, weights


def _affine(targets: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Least-squares weights summing to one: the KKT system [P Pᵀ 1; 1ᵀ 0] w = [P t; 1]."""
    count, k, _ = chosen.shape
    gram = torch.bmm(chosen, chosen.transpose(1, 2))
    ones = torch.ones((count, k, 1), dtype=gram.dtype, device=gram.device)
    system = torch.cat([torch.cat([gram, ones], dim=2),
                        torch.cat([ones.transpose(1, 2), torch.zeros((count, 1, 1), dtype=gram.dtype,
                                                                     device=gram.device)], dim=2)], dim=1)
    rhs = torch.cat([torch.bmm(targets.unsqueeze(1), chosen.transpose(1, 2)).squeeze(1),
                     torch.ones((count, 1), dtype=gram.dtype, device=gram.device)], dim=1)
    weights: torch.Tensor = least_squares(system, rhs.unsqueeze(-1)).squeeze(-1)[..., :k]
    return weights


def subword(model: torch.Tensor, pieces: tuple[tuple[int, ...], ...], how: str, *, lm_head: bool) -> torch.Tensor:
    """Each token's row from MODEL's rows of the pieces MODEL's tokenizer cuts it into, in MODEL's dtype: their
    mean, sum, weighted mean (weights 1..n, the last piece heaviest for the embedding, the first for the head) or
    the last piece (embedding) / first (head); zero for a token of no piece. Pieces past MODEL's rows are left out."""
    out = torch.zeros((len(pieces), model.shape[1]), dtype=model.dtype, device=model.device)
    for i, ids in enumerate(pieces):
        ids = tuple(j for j in ids if j < model.shape[0])
        if not ids:
            continue
        if how in ("mean", "sum"):
            for j in ids:
                out[i] += model[j]
            if how == "mean":
                out[i] /= len(ids)
        elif how == "weighted_mean":
            weights = list(range(1, len(ids) + 1))
            if not lm_head:
                weights.reverse()
            for j, w in zip(ids, weights, strict=True):
                out[i] += w * model[j]
            out[i] /= sum(weights)
        else:
            out[i] = model[ids[0] if lm_head else ids[-1]]
    return out


def hewitt(stats: ModelStats, count: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``count`` draws of N(μ, Σ) fitted to MODEL's rows (Hewitt, "Initializing new word embeddings for
    pretrained language models", 2021), drawn in float32 then cast to ``dtype``; N(0, 0.02²) when Σ is not
    positive definite (fewer rows than the width, dependent rows)."""
    if stats.covariance is None:
        raise ValueError("internal: john_hewitt needs MODEL's covariance (ModelStats.covariance)")
    mean, width = stats.mean.float(), stats.mean.shape[0]
    factor, info = torch.linalg.cholesky_ex(stats.covariance.float())
    draws = torch.randn((count, width), generator=generator, dtype=torch.float32, device=mean.device)
    if int(info) != 0:
        return (draws * _HEWITT_FALLBACK).to(dtype)
    drawn: torch.Tensor = (mean + draws @ factor.T).to(dtype)
    return drawn


def model_stats(chunks: Iterable[torch.Tensor], *, covariance: bool) -> ModelStats:
    """:class:`ModelStats` of the matrix whose consecutive row ranges ``chunks`` are (float64 sums)."""
    total: torch.Tensor | None = None
    outer: torch.Tensor | None = None
    rows = 0
    for chunk in chunks:
        wide = chunk.double()
        total = wide.sum(dim=0) if total is None else total + wide.sum(dim=0)
        if covariance:
            outer = wide.T @ wide if outer is None else outer + wide.T @ wide
        rows += chunk.shape[0]
    if total is None or rows == 0:
        raise ValueError("internal: MODEL's matrix has no rows")
    mean = total / rows
    spread = None if outer is None else outer / rows - torch.outer(mean, mean)
    return ModelStats(mean, spread, rows)


def landmark_pca(targets: torch.Tensor, donor_points: torch.Tensor, model_points: torch.Tensor) -> torch.Tensor:
    """Targets carried from DONOR's space to MODEL's through the shared tokens (float32): both sides centred and
    projected on their first min(widths) principal axes (exact SVD), the orthogonal map R minimizing
    ‖A R − B‖ between the projected landmarks (Procrustes: R = U Vᵀ of svd(Aᵀ B)), then back to MODEL's space."""
    a, b, t = donor_points.float(), model_points.float(), targets.float()
    width = min(a.shape[1], b.shape[1])
    mean_a, mean_b = a.mean(dim=0, keepdim=True), b.mean(dim=0, keepdim=True)
    axes_a = torch.linalg.svd(a - mean_a, full_matrices=False).Vh[:width].T
    axes_b = torch.linalg.svd(b - mean_b, full_matrices=False).Vh[:width].T
    pa, pb = (a - mean_a) @ axes_a, (b - mean_b) @ axes_b
    u, _, vh = torch.linalg.svd(pa.T @ pb)
    carried: torch.Tensor = ((t - mean_a) @ axes_a) @ (u @ vh) @ axes_b.T + mean_b
    return carried


def token_basis(targets: torch.Tensor, donor_points: torch.Tensor, model_points: torch.Tensor,
                k: int) -> torch.Tensor:
    """Sparse token basis (float32): the first min(widths) principal axes of the narrower model's centred shared
    rows, each approximated by OMP as a combination of ``k`` of those centred rows; the same combinations of the
    two models' centred shared rows are a DONOR basis and a MODEL basis; each target (less DONOR's shared mean) is
    solved by least squares on DONOR's basis and its coefficients applied to MODEL's, plus MODEL's shared mean."""
    a, b, t = donor_points.float(), model_points.float(), targets.float()
    mean_a, mean_b = a.mean(dim=0, keepdim=True), b.mean(dim=0, keepdim=True)
    ca, cb = a - mean_a, b - mean_b
    source = ca if a.shape[1] < b.shape[1] else cb
    width = min(a.shape[1], b.shape[1])
    covariance = source.T @ source / source.shape[0]
    axes = torch.linalg.svd(covariance).U[:, :width]
    picked, weights = batch_omp(axes.T.contiguous(), source, k)
    basis_a = torch.bmm(weights.unsqueeze(1), ca[picked]).squeeze(1)
    basis_b = torch.bmm(weights.unsqueeze(1), cb[picked]).squeeze(1)
    coeffs = least_squares(basis_a.T, (t - mean_a).T).T
    carried: torch.Tensor = coeffs @ basis_b + mean_b
    return carried


def mp_rope(targets: torch.Tensor, donor_points: torch.Tensor, model_points: torch.Tensor, k: int,
            rope: tuple[Rope, Rope]) -> torch.Tensor:
    """Matching pursuit whose atoms may turn by a RoPE position (float32, float64 for float64 targets): at each of
    ``k`` steps the unpicked shared DONOR row of largest ``|residual · atom|``, the position that best turns it
    onto the residual (or its negation, the smaller position), its coefficient ⟨r, a⟩/‖a‖² and the residual
    update; then least squares of the target on the turned atoms, and the result Σ c · RoPE(MODEL's row, position)
    in MODEL's heads and base."""
    donor_rope, model_rope = rope
    count, n = targets.shape[0], donor_points.shape[0]
    if k > n:
        raise ValueError(f"-k {k} atoms cannot be chosen from {n} shared tokens")
    dtype = targets.dtype if targets.dtype in (torch.float32, torch.float64) else torch.float32
    t, a, b = targets.to(dtype), donor_points.to(dtype), model_points.to(dtype)
    picked = torch.zeros((count, k), dtype=torch.long, device=t.device)
    positions = torch.zeros((count, k), dtype=dtype, device=t.device)
    score = t.new_empty((count, n))
    residual = t.clone()
    for step in range(k):
        best = next_atoms(residual, a, picked, step, score)
        atom = a[best]
        plus = rope_position(atom, residual, donor_rope)
        minus = rope_position(atom, -residual, donor_rope)
        position = torch.where(plus.abs() < minus.abs(), plus, minus)
        positions[:, step] = position
        turned = apply_rope(atom, position, donor_rope)
        coeff = (residual * turned).sum(dim=1) / turned.pow(2).sum(dim=1).clamp(min=1e-8)
        residual = residual - coeff.unsqueeze(1) * turned
    turned_all = apply_rope(a[picked], positions, donor_rope)
    coeffs = least_squares(turned_all.transpose(1, 2), t.unsqueeze(-1))
    atoms = apply_rope(b[picked], positions, model_rope)
    carried: torch.Tensor = torch.bmm(coeffs.transpose(1, 2), atoms).squeeze(1)
    return carried


def _inverse_frequencies(rope: Rope, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=like.device).float() / head_dim
    return (1.0 / (rope.base ** exponents)).to(like.dtype)


def rope_position(x: torch.Tensor, y: torch.Tensor, rope: Rope) -> torch.Tensor:
    """The position p (one per row) whose rotation of ``x`` best matches ``y``: each head's pair angles
    atan2(x ∧ y, x · y) projected on the unit inverse-frequency vector, over √heads · ‖inverse frequencies‖
    (exact when ``y`` is ``x`` turned by p with no angle wrapped)."""
    head_dim = x.shape[-1] // rope.heads
    half = head_dim // 2
    xs, ys = x.reshape(*x.shape[:-1], rope.heads, head_dim), y.reshape(*y.shape[:-1], rope.heads, head_dim)
    xi, xj, yi, yj = xs[..., :half], xs[..., half:], ys[..., :half], ys[..., half:]
    angles = torch.atan2(xi * yj - xj * yi, xi * yi + xj * yj)
    freq = _inverse_frequencies(rope, head_dim, x)
    direction = freq.expand(rope.heads, half).reshape(-1)
    direction = direction / (direction.norm() + 1e-8)
    projection = (angles.reshape(*x.shape[:-1], -1) * direction).sum(dim=-1)
    scale = torch.sqrt(torch.tensor(float(rope.heads), dtype=x.dtype, device=x.device)) * freq.norm()
    position: torch.Tensor = projection / (scale + 1e-8)
    return position


def apply_rope(x: torch.Tensor, position: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``x`` (..., heads · head_dim) turned by RoPE at ``position`` (...,), transformers' Llama layout: pair
    (i, i + head_dim/2) of each head turned by position · inverse frequency i."""
    head_dim = x.shape[-1] // rope.heads
    half = head_dim // 2
    xs = x.reshape(*x.shape[:-1], rope.heads, head_dim)
    theta = position.unsqueeze(-1).unsqueeze(-1) * _inverse_frequencies(rope, head_dim, x)
    cos, sin = torch.cos(theta), torch.sin(theta)
    xi, xj = xs[..., :half], xs[..., half:]
    return torch.cat([xi * cos - xj * sin, xj * cos + xi * sin], dim=-1).reshape(x.shape)


def method_notes(method: Method, donor_dtype: str) -> tuple[str, ...]:
    """Where this run's approximation departs from mergekit-tokensurgeon 0.1.5 (the log, status and the card)."""
    notes = []
    if method.name == "common_interpolation" and donor_dtype in ("F16", "BF16"):
        notes.append("common_interpolation of a half-precision DONOR measures and weighs in float32 "
                     "(mergekit-tokensurgeon 0.1.5 fails on the dtype mismatch)")
    if method.name == "mean" and method.noise:
        notes.append("mean with --new-vocab-noise adds noise to each row's own copy (0.1.5 fails writing into "
                     "an expanded view)")
    if method.name == "landmark_pca":
        notes.append("landmark_pca takes exact principal axes and the Procrustes rotation of DONOR's landmarks "
                     "onto MODEL's (0.1.5's randomized PCA follows the torch seed and its rotation is transposed)")
    if method.name == "john_hewitt":
        notes.append("john_hewitt draws from a generator seeded per batch; a covariance that is not positive "
                     "definite falls back to N(0, 0.02²) rows (0.1.5 fails there)")
    if method.name == "stb":
        notes.append("stb is computed (0.1.5 always fails, passing its options as k); its basis combinations "
                     "are applied to each model's centred shared rows and targets are centred by DONOR's shared "
                     "mean (0.1.5's code applies them to uncentred rows and uses whole-matrix means)")
    if method.name == "mp_rope":
        notes.append("mp_rope reads the RoPE theta from rope_parameters where a config has no rope_theta "
                     "(mergekit-tokensurgeon 0.1.5 fails on transformers 5 configs)")
    if method.name in ("mp_rope", "stb") or (method.name == "common_interpolation"
                                             and method.weight_scheme != "distance_proportional"):
        notes.append("least squares take lstsq's minimum-norm solution, the same bits on every call "
                     "(mergekit-tokensurgeon 0.1.5's solver reads its column pivots from uninitialized memory: "
                     "its low bits vary, and a rank-deficient system, such as two equal neighbours, may lose "
                     "columns and miss the least-squares fit)")
    if method.name == "randn" or method.noise:
        notes.append("random rows and noise come from a generator seeded per batch (--random-seed, the matrix, "
                     "the batch), so a resumed run draws the same numbers; they differ from 0.1.5's global draws")
    return tuple(notes)
