"""The numpy path of the 2-bit i-quants (IQ2_XXS, IQ2_XS, IQ2_S), taken where numba is missing: :mod:`.iq2loop`'s
kernels vectorised across blocks, to the same bytes.

Each step is the kernels' float32 operation over every block at once, laid out element-major (values, blocks) so
that every sum is :func:`.ksearch.fsum`'s sequential one; C's scans (``MAX`` from the first value, the least
``w·x²`` on strict ``<``) run position by position with ``np.where``. The groups off the grid try their neighbours
as one ragged run (the first least distance of each list: C's strict ``<`` from FLT_MAX, a NaN distance never
taken); ``make_qp_quants``' descent runs its five passes for every block (a pass that changes nothing in a block
would change nothing again), its codes stored as C's uint8 (a negative code wrapped). About a hundred times slower
than the compiled kernels (measured on 64 x 1024 rows): a fallback, numba being in the ``kquants`` extra.
"""

from __future__ import annotations

import numpy as np

from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.iq2loop import XXS, S
from resumerge.outputs.gguf.kfloat import EPS, F

__all__ = ["encode"]

_Array = np.ndarray
_BIG = F(3.4028234663852886e38)  # FLT_MAX


def _prepare(block: _Array, qw: _Array | None, offset: int, kind: int) -> tuple[_Array, _Array, _Array, _Array]:
    """:func:`.iq2loop._prepare`: (xval, weight, waux (B, 256) float32, signs (B, 32) int64)."""
    b = block.shape[0]
    xt = np.ascontiguousarray(block.T)
    sumx2 = ks.fsum(xt * xt)
    sigma2 = F(2) * sumx2 / F(256) if kind == S else sumx2 / F(256)
    squares = block * block
    if qw is None:
        weight = F(0.25) * sigma2[:, None] + squares
    else:
        weight = qw[(offset + np.arange(b)) % qw.shape[0]] * np.sqrt(sigma2[:, None] + squares)
    waux = np.sqrt(weight)
    negative = ~(block >= 0)
    xval = np.where(negative, -block, block)
    bits = (negative.reshape(b, 32, 8) << np.arange(8)).sum(axis=2)
    if kind != S:
        odd = negative.reshape(b, 32, 8).sum(axis=2) % 2 == 1
        each = (weight * block * block).reshape(b, 32, 8)
        least, low = each[:, :, 0], np.zeros((b, 32), dtype=np.int64)
        for i in range(1, 8):
            smaller = each[:, :, i] < least
            least = np.where(smaller, each[:, :, i], least)
            low = np.where(smaller, i, low)
        groups = xval.reshape(b, 32, 8)
        rows, cols = np.nonzero(odd)
        groups[rows, cols, low[rows, cols]] *= F(-1)
        bits = np.where(odd, bits ^ (1 << low), bits) & 127
    return xval, weight, waux, bits


def _start(xval: _Array, weight: _Array) -> _Array:
    """:func:`.iq2loop._start` of blocks (32, S): ``make_qp_quants(32, 4, …)``'s scale (S,)."""
    top = F(4)
    peak = np.zeros(xval.shape[1], dtype=F)
    for i in range(32):
        peak = np.where(peak > xval[i], peak, xval[i])
    zero = peak < EPS
    peak = np.where(zero, F(1), peak)
    iscale = top / peak
    stored = (ks.ni(iscale * xval).astype(np.int64) & 255).astype(F)
    diff = xval - (F(1) / iscale) * stored
    best = ks.fsum(weight * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        trial = (F(0.1) * F(step) + top) / peak
        diff = xval - (F(1) / trial) * np.minimum(top, ks.ni(trial * xval))
        mse = ks.fsum(weight * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, trial, iscale)
    q = np.minimum(top, ks.ni(iscale * xval))
    sumlx, suml2 = ks.fsum(weight * xval * q), ks.fsum(weight * q * q)
    codes = (q.astype(np.int64) & 255).astype(F)  # stored wrapped, summed as it was
    for _ in range(5):
        for i in range(32):
            w, v, was = weight[i], xval[i], codes[i]
            slx = sumlx - w * v * was
            sl2 = suml2 - w * was * was
            tried = (slx > 0) & (sl2 > 0)
            new = np.minimum(top, ks.ni(v * sl2 / np.where(tried, slx, F(1))))
            slx = slx + w * v * new
            sl2 = sl2 + w * new * new
            keep = tried & (new != was) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            codes[i] = np.where(keep, (new.astype(np.int64) & 255).astype(F), was)
            sumlx = np.where(keep, slx, sumlx)
            suml2 = np.where(keep, sl2, suml2)
    found: _Array = np.where(zero | ~(suml2 > 0), F(0), sumlx / np.where(suml2 > 0, suml2, F(1)))
    return found


def off_grid_candidates(at: _Array, neighbours: _Array) -> tuple[_Array, _Array, _Array]:
    """Every off-grid group's neighbour list, one after another (the lists are ragged: 4 to 12 long on average, up
    to 292): ``at`` is each list's place in ``neighbours`` (its length, then its grid points). The list each
    candidate belongs to, where each list starts, and the candidates (int64)."""
    count = neighbours[at].astype(np.int64)
    owner = np.repeat(np.arange(at.size), count)
    heads = np.concatenate([[0], np.cumsum(count)[:-1]])
    return owner, heads, neighbours[np.repeat(at + 1 - heads, count) + np.arange(owner.size)].astype(np.int64)


def first_least(d2: _Array, owner: _Array, heads: _Array, candidates: _Array) -> _Array:
    """Each list's candidate of least distance ``d2`` (of :func:`off_grid_candidates`' lists), the first of equals:
    the one llama.cpp's scan in list order keeps."""
    least = np.minimum.reduceat(d2, heads)
    first = np.flatnonzero(d2 == least[owner])
    return candidates[first[np.unique(owner[first], return_index=True)[1]]]


def _round(xval: _Array, inverse: _Array, this_scale: _Array, waux: _Array, tables: tuple[_Array, _Array, _Array],
           groups: int) -> tuple[_Array, _Array]:
    """Every group of blocks (size, S) rounded at ``inverse`` to levels 0..2 and, off the grid, moved to its
    nearest neighbour at ``this_scale``: (levels (size, S) int64, whether each group was on the grid (groups, S))."""
    grid, kmap, neighbours = tables
    q = np.clip(ks.ni(F(0.5) * (inverse * xval - F(1))), 0, 2).astype(np.int64)
    keys = (q.reshape(groups, 8, -1) << (2 * np.arange(8))[None, :, None]).sum(axis=1)
    point = kmap[keys]
    off = point < 0
    k, s = np.nonzero(off)
    if k.size:
        owner, heads, candidates = off_grid_candidates(-point[k, s] - 1, neighbours)
        rows, cols = 8 * k[owner], s[owner]
        d2 = np.zeros(owner.size, dtype=F)
        for i in range(8):
            diff = this_scale[cols] * grid[candidates, i].astype(F) - xval[rows + i, cols]
            d2 = d2 + waux[rows + i, cols] * diff * diff
        d2 = np.where(np.isnan(d2), F(np.inf), d2)  # never below FLT_MAX, as C's strict < from it
        chosen = first_least(d2, owner, heads, candidates)
        levels = (grid[chosen].astype(np.int64) - 1) // 2
        for i in range(8):
            q[8 * k + i, s] = levels[:, i]
    return q, ~off


def _fit(weight: _Array, xval: _Array, q: _Array) -> tuple[_Array, _Array]:
    codes = (2 * q + 1).astype(F)
    return ks.fsum(weight * xval * codes), ks.fsum(weight * codes * codes)


def _search(xval: _Array, weight: _Array, waux: _Array, start: _Array, kind: int,
            tables: tuple[_Array, _Array, _Array]) -> tuple[_Array, _Array, _Array, _Array]:
    """:func:`.iq2loop._search`'s scale search of blocks (size, S): (levels (size, S), scale (S,), empty (S,),
    flipped (S,))."""
    size = xval.shape[0]
    groups = size // 8
    peak = xval[0]
    for i in range(1, size):
        peak = np.where(peak > xval[i], peak, xval[i])
    empty = peak < (EPS if kind != S else F(1e-8))
    if kind == XXS:
        scale, reach = start, start * F(3)
        empty |= reach <= 0
    else:
        scale, reach = peak / F(5), peak
    reach = np.where(empty, F(1), reach)
    best = np.zeros_like(scale)
    level = np.zeros(xval.shape, dtype=np.int64)
    on_grid = np.ones((groups, xval.shape[1]), dtype=bool)
    low, high = (-6, 7) if kind == XXS else (-9, 10)
    for step in range(low, high):
        inverse = (F(5) + F(step) * F(0.1)) / reach
        trial, on = _round(xval, inverse, F(1) / inverse, waux, tables, groups)
        sumqx, sumq2 = _fit(weight, xval, trial)
        adopt = ~empty & (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = np.where(adopt, sumqx / np.where(adopt, sumq2, F(1)), scale)
        best = np.where(adopt, scale * sumqx, best)
        level = np.where(adopt, trial, level)
        on_grid = np.where(adopt, on, on_grid)
    refit = ~empty & (scale > 0) & (True if kind == XXS else ~on_grid.all(axis=0))
    if refit.any():
        live = np.where(refit, scale, F(1))
        trial, _ = _round(xval, F(1) / live, live, waux, tables, groups)
        if kind != XXS:  # only the groups off the grid again
            redo = np.repeat(~on_grid, 8, axis=0)
            trial = np.where(redo, trial, level)
        sumqx, sumq2 = _fit(weight, xval, trial)
        level = np.where(refit, trial, level)
        scale = np.where(refit & (sumq2 > 0), sumqx / np.where(sumq2 > 0, sumq2, F(1)), scale)
    flipped = scale < 0
    return level, np.where(flipped, -scale, scale), empty, flipped


def encode(block: _Array, qw: _Array | None, offset: int, kind: int, tables: tuple[_Array, _Array, _Array],
           out: _Array) -> _Array:
    """Super-blocks ``block`` (float32 (B, 256)) as :func:`.iq2loop._search` writes them into ``out`` (uint8 (B,
    block bytes - 2)); returns each super-block's ``d`` (float32 (B,))."""
    b = block.shape[0]
    size = 32 if kind == XXS else 16
    blocks = 256 // size
    xval, weight, waux, signs = _prepare(block, qw, offset, kind)

    def columns(a: _Array) -> _Array:  # (B, 256) -> (size, B * blocks): block j of super-block i in column i*blocks+j
        return np.ascontiguousarray(a.reshape(b * blocks, size).T)

    start = _start(columns(xval), columns(weight)) if kind == XXS else np.zeros(b * blocks, dtype=F)
    level, scale, empty, flipped = _search(columns(xval), columns(weight), columns(waux), start, kind, tables)
    kmap = tables[1]
    keys = (level.reshape(size // 8, 8, -1) << (2 * np.arange(8))[None, :, None]).sum(axis=1)  # (groups, S)
    points = np.maximum(kmap[keys], 0).T.reshape(b, 32)
    written = np.repeat(~empty.reshape(b, blocks), 32 // blocks, axis=1)  # per group
    sign = np.where(np.repeat(flipped.reshape(b, blocks), 32 // blocks, axis=1), ~signs & (255 if kind == S else 127),
                    signs)
    points, sign = np.where(written, points, 0), np.where(written, sign, 0)
    out[...] = 0
    if kind == XXS:
        words = out.reshape(b, 8, 8)
        words[:, :, 0:4] = points.reshape(b, 8, 4)
        packed = (sign.reshape(b, 8, 4) << (7 * np.arange(4))).sum(axis=2)
        words[:, :, 4:8] = (packed[:, :, None] >> (8 * np.arange(4))) & 255
    elif kind == S:
        out[:, 0:32] = points & 255
        out[:, 32:64] = sign
        out[:, 64:72] = ((points >> 8).reshape(b, 8, 4) << (2 * np.arange(4))).sum(axis=2)
    else:
        entry = points | (sign << 9)
        out[:, 0:64:2] = entry & 255
        out[:, 1:64:2] = entry >> 8
    scales = np.where(empty, F(0), scale).reshape(b, blocks)
    max_scale = np.zeros(b, dtype=F)
    for j in range(blocks):
        max_scale = np.where(max_scale > scales[:, j], max_scale, scales[:, j])
    none = max_scale == 0
    if kind != S:
        out[none] = 0
    whole = max_scale / F(31)
    inverse = F(1) / np.where(none, F(1), whole)
    nibbles = np.clip(ks.ni(F(0.5) * (inverse[:, None] * scales - F(1))), 0, 15).astype(np.int64)
    nibbles[none] = 0
    if kind == XXS:
        out.reshape(b, 8, 8)[:, :, 7] |= (nibbles << 4).astype(np.uint8)
    else:
        at = 64 if kind != S else 72
        out[:, at:at + 8] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    d: _Array = np.where(none, F(0), whole * F(0.9875) if kind == S else whole)
    return d
