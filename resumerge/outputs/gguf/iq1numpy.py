"""The numpy path of the 1-bit i-quants (IQ1_S, IQ1_M), taken where numba is missing: :mod:`.iq1loop`'s kernel
vectorised across blocks, to the same bytes.

Each step is the kernel's float32 operation over every block at once, laid out element-major (values, blocks) so
that every sum is sequential (:func:`.ksearch.fsum`, or an explicit running sum); the sort is numpy's stable
argsort (equal values in index order, as the kernel's insertion sort and glibc's ``qsort`` leave them; a block
with a NaN adopts nothing either way). The candidates' adoption is C's running comparison, one candidate at a time
over all blocks; a group off the grid tries its neighbours as one ragged run (the first least error: C's strict
``<`` from FLT_MAX, NaN never taken; none: the first). A fallback, numba being in the ``kquants`` extra.
"""

from __future__ import annotations

import numpy as np

from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.iq2numpy import first_least, off_grid_candidates
from resumerge.outputs.gguf.kfloat import F

__all__ = ["encode"]

_Array = np.ndarray
_BIG = F(3.4028234663852886e38)  # FLT_MAX
# the levels of each shift: x_p (+DELTA), x_m (-DELTA)
_LEVELS = np.array([[-0.875, 0.125, 1.125], [-1.125, -0.125, 0.875]], dtype=F)
_MASKS = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.uint8)


def _running(t: _Array) -> _Array:
    """Prefix sums (n + 1, S) of terms ``t`` (n, S), each from 0 in order (C's ``s[j+1] = s[j] + t[j]``)."""
    out = np.zeros((t.shape[0] + 1, t.shape[1]), dtype=F)
    for j in range(t.shape[0]):
        out[j + 1] = out[j] + t[j]
    return out


def _adopt(state: list[_Array], sqx: _Array, sq2: _Array, tag: tuple[int, int, int]) -> None:
    """C's strict-improvement step for one candidate over all blocks: ``state`` = [best, scale, i1, i2, shift]."""
    best = state[0]
    take = (sq2 > 0) & (sqx * sqx > best * sq2)
    if take.any():
        scale = np.where(take, sqx / np.where(take, sq2, F(1)), state[1])
        state[0] = np.where(take, scale * sqx, best)
        state[1] = scale
        for at, value in zip((2, 3, 4), tag, strict=True):
            state[at] = np.where(take, value, state[at])


def _search(xs: _Array, ws: _Array, half: _Array, top: _Array, medium: bool) -> list[_Array]:
    """Each block's best split and shift of sorted values ``xs`` with weights ``ws`` (size, S) (``half``: whether
    each sorted value is of the block's second half): [best, scale, i1, i2, shift], i1 -1 where none."""
    size, columns = xs.shape
    state = [np.full(columns, -_BIG), top.copy(), np.full(columns, -1), np.full(columns, -1), np.zeros(columns, int)]
    terms = ws * xs
    if not medium:
        sumx, sumw = _running(terms), _running(ws)
        for i1 in range(size + 1):
            for i2 in range(i1, size + 1):
                runs = (sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[size] - sumx[i2])
                wts = (sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[size] - sumw[i2])
                for s in range(2):
                    p = _LEVELS[s]
                    sqx = runs[0] * p[0] + runs[1] * p[1] + runs[2] * p[2]
                    sq2 = wts[0] * p[0] * p[0] + wts[1] * p[1] * p[1] + wts[2] * p[2] * p[2]
                    _adopt(state, sqx, sq2, (i1, i2, 1 - 2 * s))
        return state
    zero = F(0)
    # each half's prefix sums: a value of the other half carries the sum over unchanged (C's copy)
    px = [np.zeros((size + 1, columns), dtype=F) for _ in (0, 1)]
    pw = [np.zeros((size + 1, columns), dtype=F) for _ in (0, 1)]
    for j in range(size):
        for h in (0, 1):
            mine = half[j] == h
            px[h][j + 1] = np.where(mine, px[h][j] + terms[j], px[h][j])
            pw[h][j + 1] = np.where(mine, pw[h][j] + ws[j], pw[h][j])
    gaps = [(p[0] * p[0] - p[1] * p[1], p[1] * p[1] - p[2] * p[2]) for p in _LEVELS]
    for i1 in range(size + 1):
        for i2 in range(i1, size + 1):
            qx = [[zero] * 2 for _ in range(2)]
            q2 = [[zero] * 2 for _ in range(2)]
            for h in (0, 1):
                sx = px[h][i1] + px[h][i2]
                for s in (0, 1):
                    v2 = _LEVELS[s, 2]
                    qx[s][h] = px[h][size] * v2 - sx
                    q2[s][h] = pw[h][size] * v2 * v2 + pw[h][i1] * gaps[s][0] + pw[h][i2] * gaps[s][1]
            for k in range(4):
                _adopt(state, qx[k // 2][0] + qx[k % 2][1], q2[k // 2][0] + q2[k % 2][1], (i1, i2, k))
    return state


def _shift_rows(shift: _Array, medium: bool, groups: int) -> _Array:
    """Each group's shift (0: +DELTA, 1: -DELTA) (groups, S) of blocks' shifts."""
    if not medium:
        return np.repeat(((1 - shift) // 2)[None], groups, axis=0)
    return np.stack([shift // 2, shift % 2])


def _neighbours(x: _Array, w: _Array, level: _Array, s_of: _Array, scale: _Array,
                tables: tuple[_Array, _Array, _Array]) -> tuple[_Array, _Array]:
    """Each group's grid point (groups, S) of levels ``level`` (size, S), off the grid the neighbour of least
    ``w``-weighted error at ``scale``; and which were on the grid (groups, S)."""
    grid, kmap, neighbours = tables
    groups = level.shape[0] // 8
    keys = (level.reshape(groups, 8, -1) << (2 * np.arange(8))[None, :, None]).sum(axis=1)
    point = kmap[keys].astype(np.int64)
    off = point < 0
    k, s = np.nonzero(off)
    if k.size:
        owner, heads, candidates = off_grid_candidates(-point[k, s] - 1, neighbours)
        rows, cols, shifts = 8 * k[owner], s[owner], s_of[k[owner], s[owner]]
        d2 = np.zeros(owner.size, dtype=F)
        for i in range(8):
            q = _LEVELS[shifts, (grid[candidates, i].astype(np.int64) - 1) // 2]
            diff = scale[cols] * q - x[rows + i, cols]
            d2 = d2 + w[rows + i, cols] * diff * diff
        d2 = np.where(d2 < _BIG, d2, F(np.inf))  # C's strict < from FLT_MAX: NaN and FLT_MAX never taken
        # the first least of each list (none finite, where llama.cpp aborts: the first)
        point[k, s] = first_least(d2, owner, heads, candidates)
    return point, ~off


def encode(block: _Array, qw: _Array | None, offset: int, medium: bool, tables: tuple[_Array, _Array, _Array],
           out: _Array, d: _Array) -> None:
    """:func:`.iq1loop._encode` in numpy: the same arguments (``qw`` None without a matrix), the same results."""
    grid = tables[0]
    b = block.shape[0]
    size = 16 if medium else 32
    blocks, groups = 256 // size, size // 8
    xt = np.ascontiguousarray(block.T)
    sigma2 = F(2) * ks.fsum(xt * xt) / F(256)
    squares = block * block
    weight = squares if qw is None else qw[(offset + np.arange(b)) % qw.shape[0]] * np.sqrt(sigma2[:, None] + squares)

    def columns(a: _Array) -> _Array:  # (B, 256) -> (size, B * blocks): block j of super-block i in column i*blocks+j
        return np.ascontiguousarray(a.reshape(b * blocks, size).T)

    x, w = columns(block), columns(weight)
    top = np.abs(x[0])
    for i in range(1, size):
        a = np.abs(x[i])
        top = np.where(top > a, top, a)
    live = np.flatnonzero(~(top < (F(1e-7) if medium else F(1e-12))))
    n = b * blocks
    scale, shift = np.zeros(n, dtype=F), np.full(n, 0 if medium else 1)
    points = np.zeros((groups, n), dtype=np.int64)
    written = np.zeros(n, dtype=bool)
    if live.size:
        xl, wl = x[:, live], w[:, live]
        order = np.argsort(xl, axis=0, kind="stable")
        state = _search(np.take_along_axis(xl, order, 0), np.take_along_axis(wl, order, 0), order >= size // 2,
                        top[live], medium)
        adopted = state[2] >= 0
        rank = np.argsort(order, axis=0)  # each value's place in the sorted order
        level = np.where(rank < state[2], 0, np.where(rank < state[3], 1, 2))
        found, kind = state[1], state[4]
        flip = found < 0
        level = np.where(flip, 2 - level, level)
        found = np.where(flip, -found, found)
        kind = np.where(flip, 3 - kind if medium else -kind, kind)
        s_of = _shift_rows(kind, medium, groups)
        point, on = _neighbours(xl, wl, level, s_of, found, tables)
        off = ~on.all(axis=0)
        q = _LEVELS[np.repeat(s_of, 8, axis=0), (grid[point.repeat(8, axis=0),
                                                     np.tile(np.arange(8), groups)[:, None]].astype(np.int64) - 1) // 2]
        sqx, sq2 = ks.fsum(np.ascontiguousarray(wl * q * xl)), ks.fsum(np.ascontiguousarray(wl * q * q))
        refit = off & (sqx > 0) & (sq2 > 0)
        found = np.where(refit, sqx / np.where(refit, sq2, F(1)), found)
        keep = live[adopted]
        scale[keep], shift[keep], points[:, keep], written[keep] = (found[adopted], kind[adopted],
                                                                    point[:, adopted], True)
    _pack(block, weight, scale, shift, points, written, medium, grid, out, d)


def _pack(block: _Array, weight: _Array, scale: _Array, shift: _Array, points: _Array, written: _Array,
          medium: bool, grid: _Array, out: _Array, d: _Array) -> None:
    """The bytes (all but the float16 ``d``) and each super-block's float32 ``d``, as :func:`.iq1loop._encode`."""
    b = block.shape[0]
    blocks = 16 if medium else 8
    points = np.where(written, points, 0).T.reshape(b, blocks, -1)  # (B, blocks, groups)
    scales = scale.reshape(b, blocks)
    shifts = shift.reshape(b, blocks)
    max_scale = np.zeros(b, dtype=F)
    for j in range(blocks):
        max_scale = np.where(max_scale > scales[:, j], max_scale, scales[:, j])
    some = max_scale != 0
    whole = max_scale / F(15)
    inverse = F(1) / np.where(some, whole, F(1))
    nibbles = np.clip(ks.ni(F(0.5) * (inverse[:, None] * scales - F(1))), 0, 7).astype(np.int64)
    out[...] = 0
    if not medium:
        out[:, 2:34] = (points & 255).reshape(b, 32)
        high = ((points >> 8) << (3 * np.arange(4))).sum(axis=2)
        high |= np.where(some[:, None], (nibbles | np.where(shifts == -1, 8, 0)) << 12, 0)
        out[:, 34:50] = high.astype("<u2").view(np.uint8).reshape(b, 16)
        d[...] = np.where(some, whole * F(1.125), F(0))
        return
    out[:, 0:32] = (points & 255).reshape(b, 32)
    qh = (points[:, :, 0] >> 8) | ((points[:, :, 1] >> 8) << 4)
    qh = np.where(some[:, None], qh | _MASKS[shifts], qh)
    out[:, 32:48] = qh
    words = (np.where(some[:, None], nibbles, 0).reshape(b, 4, 4) << (3 * np.arange(4))).sum(axis=2)
    out[:, 48:56] = words.astype("<u2").view(np.uint8).reshape(b, 8)
    # the super-block's d fitted again at the blocks' 3-bit scales, summed over its 256 values in order
    lv = (grid[points.reshape(b, 32)].astype(np.int64) - 1) // 2  # (B, 32, 8)
    s_of = np.stack([shifts // 2, shifts % 2], axis=2).reshape(b, 32)
    q = _LEVELS[s_of[:, :, None], lv] * (2 * nibbles + 1).astype(F).repeat(2, axis=1)[:, :, None]
    q = q.reshape(b, 256)
    sqx = ks.fsum(np.ascontiguousarray((weight * q * block).T))
    sq2 = ks.fsum(np.ascontiguousarray((weight * q * q).T))
    fitted = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, F(1)), whole)
    d[...] = np.where(some, fitted * F(1.1125), F(0))
