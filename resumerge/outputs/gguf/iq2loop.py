"""The 2-bit i-quants' quantizer (IQ2_XXS, IQ2_XS, IQ2_S): llama.cpp's ``quantize_row_iq2_*_impl`` as scalar loops
numba compiles (:mod:`.jit`), in the same float32 operations and order, to the same bytes; where numba is missing
:mod:`.iq2numpy` takes the same steps vectorised across blocks (and these functions run uncompiled, :data:`plain`,
are the tests' reference).

Per super-block of 256 values (``_prepare``): σ² the mean square (IQ2_S: twice it), each value's weight
``qw · sqrt(σ² + x²)`` (IQ2_S without a matrix: ``σ²/4 + x²``), ``waux`` its root, each group of eight's
magnitudes and sign bits; IQ2_XXS and IQ2_XS keep seven sign bits, so where a group has an odd count of negatives
the value of least ``w·x²`` takes the other sign (the first such, on strict ``<``). Then per block of 32 values
(IQ2_XXS) or 16 (``_search``): a ladder of trial scales (IQ2_XXS: 13 around ``make_qp_quants``' scale of the
magnitudes, :func:`.ksearch.qp`, computed before; else 19 around ``max/5``), each group rounded to levels 0..2 and,
off the grid, replaced by its nearest neighbour under ``waux``-weighted distance at that scale; the best trial's
(``Σwqx² / Σwq²``, strict improvement) groups, then the scale refitted to the grid points the groups end on
(IQ2_XXS always, the others where a chosen group was off the grid). The super-block's ``d`` is the largest block
scale over 31 (IQ2_S writes it times 0.9875), each block's 4-bit scale ``nearest_int(0.5·(scale/d − 1))``.

``nearest_int`` is written out as :func:`.ksearch.ni`'s bits (exact where C's trick wraps), ``MAX`` as C's
``a > b ? a : b``. The float16 ``d`` is rounded by the caller (:func:`.ksearch.f16`); the kernels return it as
float32. This module imports numpy, :mod:`.jit` and :mod:`.kfloat` only (numba's disk cache is keyed on this
file: MAGIC and EPS, read from :mod:`.kfloat`, are frozen into cached kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from resumerge.outputs.gguf import jit
from resumerge.outputs.gguf import kfloat as kf

__all__ = ["XS", "XXS", "Kernels", "S", "kernels", "plain"]

_Array = np.ndarray
# the kinds these kernels take (not ggml ids: the kernels are compiled once for all three)
XXS, XS, S = 0, 1, 2


class Kernels(NamedTuple):
    """The kernels (compiled, or the plain functions): ``prepare`` then ``search``, documented below."""

    prepare: Callable[[_Array, _Array, int, int, _Array, _Array, _Array, _Array], None]
    start: Callable[[_Array, _Array, _Array], None]
    search: Callable[[_Array, _Array, _Array, _Array, _Array, int, tuple[_Array, _Array, _Array], _Array, _Array], None]


def _prepare(block: _Array, qw: _Array, offset: int, kind: int, xval: _Array, weight: _Array, waux: _Array,
             signs: _Array) -> None:
    """Each value's magnitude ``xval``, weight and ``waux`` (float32 (B, 256)) and each group of eight's sign bits
    (uint8 (B, 32)) of super-blocks ``block`` (float32 (B, 256)), super-block b weighted by row ``(offset + b) %
    len(qw)`` of ``qw`` (rows of 256), or (IQ2_S only) by ``σ²/4 + x²`` where ``qw`` has no rows."""
    f32 = np.float32
    supers = block.shape[0]
    rows = qw.shape[0]
    for b in range(supers):
        x = block[b]
        sumx2 = f32(0.0)
        for e in range(256):
            sumx2 += x[e] * x[e]
        sigma2 = f32(2.0) * sumx2 / f32(256.0) if kind == S else sumx2 / f32(256.0)
        for e in range(256):
            if rows > 0:
                weight[b, e] = qw[(offset + b) % rows, e] * np.sqrt(sigma2 + x[e] * x[e])
            else:
                weight[b, e] = f32(0.25) * sigma2 + x[e] * x[e]
            waux[b, e] = np.sqrt(weight[b, e])
        for g in range(32):
            at = 8 * g
            s = 0
            flips = 0
            for i in range(8):
                v = x[at + i]
                if v >= f32(0.0):
                    xval[b, at + i] = v
                else:
                    xval[b, at + i] = -v
                    flips += 1
                    s |= 1 << i
            if kind != S and flips % 2 == 1:  # seven stored signs: the eighth makes the count even
                low = 0
                least = weight[b, at] * x[at] * x[at]
                for i in range(1, 8):
                    this = weight[b, at + i] * x[at + i] * x[at + i]
                    if this < least:
                        least = this
                        low = i
                xval[b, at + low] = -xval[b, at + low]
                s ^= 1 << low
            signs[b, g] = s & 127 if kind != S else s


def _start(xval: _Array, weight: _Array, start: _Array) -> None:
    """IQ2_XXS's first scale of each 32-value block into ``start`` (float32 (B, 8)): ``make_qp_quants(32, 4, xval,
    L, weight)`` of :func:`_prepare`'s arrays. Its codes are C's uint8: a negative code (the one magnitude the sign
    parity negated can round below 0) is stored wrapped, 256 + code, and read back so, while the sums it was
    adopted into keep the negative value, as C's do."""
    f32 = np.float32
    zero, one = f32(0.0), f32(1.0)
    top = f32(4.0)
    magic = kf.MAGIC
    codes = np.zeros(32, dtype=np.int64)
    for b in range(xval.shape[0]):
        for ib in range(8):
            base = 32 * ib
            peak = zero
            for i in range(32):
                peak = peak if peak > xval[b, base + i] else xval[b, base + i]
            if peak < kf.EPS:
                start[b, ib] = zero
                continue
            iscale = top / peak
            scale = one / iscale
            best = zero
            for i in range(32):
                q = (np.float32(iscale * xval[b, base + i] + magic).view(np.int32) & 0x7FFFFF) - 0x400000
                stored = q & 255  # a uint8
                diff = xval[b, base + i] - scale * f32(stored)
                best += weight[b, base + i] * diff * diff
            for step in range(-4, 5):
                if step == 0:
                    continue
                trial = (f32(0.1) * f32(step) + top) / peak
                trial_scale = one / trial
                mse = zero
                for i in range(32):
                    q = (np.float32(trial * xval[b, base + i] + magic).view(np.int32) & 0x7FFFFF) - 0x400000
                    q = 4 if q > 4 else q
                    diff = xval[b, base + i] - trial_scale * f32(q)
                    mse += weight[b, base + i] * diff * diff
                if mse < best:
                    best = mse
                    iscale = trial
            sumlx, suml2 = zero, zero
            for i in range(32):
                q = (np.float32(iscale * xval[b, base + i] + magic).view(np.int32) & 0x7FFFFF) - 0x400000
                q = 4 if q > 4 else q
                codes[i] = q & 255  # stored wrapped, summed as it is
                w = weight[b, base + i]
                sumlx += w * xval[b, base + i] * f32(q)
                suml2 += w * f32(q) * f32(q)
            for _ in range(5):
                changed = 0
                for i in range(32):
                    w = weight[b, base + i]
                    v = xval[b, base + i]
                    slx = sumlx - w * v * f32(codes[i])
                    sl2 = suml2 - w * f32(codes[i]) * f32(codes[i])
                    if slx > zero and sl2 > zero:
                        p = v * sl2 / slx
                        new = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000
                        new = 4 if new > 4 else new
                        if new != codes[i]:
                            slx += w * v * f32(new)
                            sl2 += w * f32(new) * f32(new)
                            if slx * slx * suml2 > sumlx * sumlx * sl2:
                                codes[i] = new & 255
                                sumlx = slx
                                suml2 = sl2
                                changed += 1
                if changed == 0:
                    break
            start[b, ib] = sumlx / suml2 if suml2 > zero else zero


def _search(xval: _Array, weight: _Array, waux: _Array, signs: _Array, start: _Array, kind: int,
            tables: tuple[_Array, _Array, _Array], out: _Array, d: _Array) -> None:
    """Each super-block's codes into ``out`` (uint8 (B, block bytes - 2), the block past its float16 ``d``) and
    its ``d`` as float32 into ``d`` (B,), from :func:`_prepare`'s arrays; ``start`` (float32 (B, 8)): IQ2_XXS's
    ``make_qp_quants`` scale of each 32-value block (unread for the others); ``tables``: :func:`.iq2grid.tables`'
    (``grid``, ``kmap``, ``neighbours``)."""
    grid, kmap, neighbours = tables
    f32 = np.float32
    zero, one, half = f32(0.0), f32(1.0), f32(0.5)
    size = 32 if kind == XXS else 16
    groups = size // 8
    blocks = 256 // size
    low_try, high_try = (-6, 7) if kind == XXS else (-9, 10)
    eps = kf.EPS if kind != S else f32(1e-8)
    packed = 64 if kind == XS else 72  # where the 4-bit scales start (IQ2_XS, IQ2_S)
    magic = kf.MAGIC
    scales = np.zeros(blocks, dtype=np.float32)
    level = np.zeros(size, dtype=np.int64)
    trial = np.zeros(size, dtype=np.int64)
    on_grid = np.ones(4, dtype=np.bool_)
    trial_on = np.ones(4, dtype=np.bool_)
    for b in range(xval.shape[0]):
        out[b, :] = 0
        max_scale = zero
        for ib in range(blocks):
            base = size * ib
            peak = xval[b, base]
            for i in range(1, size):
                peak = peak if peak > xval[b, base + i] else xval[b, base + i]
            level[:] = 0
            if peak < eps:
                scales[ib] = zero
                continue
            if kind == XXS:
                scale = start[b, ib]
                reach = scale * f32(3.0)
                if reach <= zero:
                    scales[ib] = zero
                    continue
            else:
                scale = peak / f32(5.0)
                reach = peak
            on_grid[:] = True
            best = zero
            # the trial scales, then (a last pass) the refit of the groups to the best trial's scale
            for step in range(low_try, high_try + 1):
                final = step == high_try
                if final:
                    if not (scale > zero) or (kind != XXS and on_grid[0] and on_grid[1]):
                        break
                    inverse = one / scale
                    this_scale = scale
                else:
                    inverse = (f32(5.0) + f32(step) * f32(0.1)) / reach
                    this_scale = one / inverse
                for k in range(groups):
                    if final and kind != XXS and on_grid[k]:  # IQ2_XS, IQ2_S: only the off-grid groups again
                        trial[8 * k:8 * k + 8] = level[8 * k:8 * k + 8]
                        continue
                    key = 0
                    for i in range(8):
                        p = half * (inverse * xval[b, base + 8 * k + i] - one)
                        q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000  # nearest_int
                        q = 0 if q < 0 else (2 if q > 2 else q)
                        trial[8 * k + i] = q
                        key |= q << (2 * i)
                    point = kmap[key]
                    trial_on[k] = point >= 0
                    if point < 0:  # iq2_find_best_neighbour at this scale
                        at = -point - 1
                        best_d2 = np.float32(3.4028234663852886e38)
                        for j in range(1, neighbours[at] + 1):
                            candidate = neighbours[at + j]
                            d2 = zero
                            for i in range(8):
                                diff = this_scale * f32(grid[candidate, i]) - xval[b, base + 8 * k + i]
                                d2 += waux[b, base + 8 * k + i] * diff * diff
                            if d2 < best_d2:
                                best_d2 = d2
                                point = candidate
                        for i in range(8):
                            trial[8 * k + i] = (grid[point, i] - 1) // 2
                sumqx, sumq2 = zero, zero
                for i in range(size):
                    w = weight[b, base + i]
                    q = f32(2 * trial[i] + 1)
                    sumqx += w * xval[b, base + i] * q
                    sumq2 += w * q * q
                if final:
                    level[:] = trial[:]
                    if sumq2 > zero:
                        scale = sumqx / sumq2
                elif sumq2 > zero and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    level[:] = trial[:]
                    on_grid[:groups] = trial_on[:groups]
            flip = scale < zero
            if flip:
                scale = -scale
            for k in range(groups):
                g = groups * ib + k
                key = 0
                for i in range(8):
                    key |= level[8 * k + i] << (2 * i)
                point = max(kmap[key], 0)  # always on the grid here (C aborts otherwise)
                sign = int(signs[b, g])
                if flip:
                    sign = (~sign) & (127 if kind != S else 255)
                if kind == XXS:
                    out[b, 8 * ib + k] = point
                    word = sign << (7 * k)
                    for byte in range(4):
                        out[b, 8 * ib + 4 + byte] |= (word >> (8 * byte)) & 255
                elif kind == XS:
                    entry = point | (sign << 9)
                    out[b, 2 * g] = entry & 255
                    out[b, 2 * g + 1] = entry >> 8
                else:
                    out[b, g] = point & 255
                    out[b, 64 + g // 4] |= (point >> 8) << (2 * (g % 4))
                    out[b, 32 + g] = sign
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == zero:
            if kind != S:
                out[b, :] = 0
            d[b] = zero
            continue
        whole = max_scale / f32(31.0)
        d[b] = whole * f32(0.9875) if kind == S else whole
        inverse = one / whole
        for ib in range(blocks):
            p = half * (inverse * scales[ib] - one)
            q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000
            q = 0 if q < 0 else (15 if q > 15 else q)
            if kind == XXS:
                out[b, 8 * ib + 7] |= q << 4
            elif ib % 2 == 0:
                out[b, packed + ib // 2] = q
            else:
                out[b, packed + ib // 2] |= q << 4
    return


kernels = jit.lazy_kernels(Kernels, _prepare, _start, _search)
# the same functions uncompiled: the reference the tests hold both paths to (too slow for a model)
plain = Kernels(_prepare, _start, _search)
