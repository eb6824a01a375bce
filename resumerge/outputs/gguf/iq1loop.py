"""The 1-bit i-quants' quantizer (IQ1_S, IQ1_M): llama.cpp's ``quantize_row_iq1_s_impl`` /
``quantize_row_iq1_m_impl`` as a scalar loop numba compiles (:mod:`.jit`), in the same float32 operations and
order, to the same bytes; where numba is missing :mod:`.iq1numpy` takes the same steps vectorised across blocks
(and this function runs uncompiled, :data:`plain`, the tests' reference).

Per super-block of 256 values: σ² twice the mean square, each value's weight ``qw · sqrt(σ² + x²)`` (IQ1_M without
a matrix: ``x²``). Per block of 32 values (IQ1_S) or 16 (IQ1_M) whose largest magnitude reaches 1e-12 (1e-7): the
values sorted ascending, and every split of that order into three runs (levels -1, 0, +1) tried, each level
shifted by +DELTA or -DELTA (IQ1_M: each half of the block its own shift, four combinations), the best least-squares
fit ``Σwqx² / Σwq²`` adopted on a strict improvement in the order C tries them. The runs' sums are read off
prefix sums of the sorted order: IQ1_S's of the block, IQ1_M's of each half apart (the search of the pinned
llama.cpp, b11739, which rewrote ggml's older from-zero sums of every candidate: the levels being 1 apart, a
half's ``Σwqx`` is ``v2·total − prefix(i1) − prefix(i2)`` and its ``Σwq²`` ``v2²·total + (v0² − v1²)·prefix(i1) +
(v1² − v2²)·prefix(i2)``, in that float32 order). A
negative fit flips the levels and the shift; a group of eight whose levels are not a grid point takes its
neighbour (:func:`.iq2grid.build`'s lists, nearest three distances) of least ``w``-weighted error at that scale,
and the block's scale is then refitted to the points. The super-block's scale ``d`` is the largest block scale
over 15 (each block's 3-bit ``nearest_int(0.5·(scale/d − 1))``), written times 1.125 (IQ1_S); IQ1_M fits ``d``
once more over the whole super-block at the blocks' 3-bit scales and writes it times 1.1125.

**The sort's ties.** C sorts the (value, index) pairs with ``qsort``, comparing the values only, so the order of
equal values is the C library's: glibc's ``qsort`` sorts arrays this small (16 or 32 pairs) with a merge sort,
which keeps equal values in index order — a stable sort, what these kernels do (an insertion sort); the oracle
(llama-cpp-py-sync 0.11739 on glibc 2.36) is held to it on blocks whose bytes change with that order
(tests/test_gguf_iq1.py). The order matters where a run of equal values has unequal weights: the prefix sums
through the run, and so the fits compared, round by it (a constant block, copies and zeros of TIES/DARE merges
with an importance matrix); a C library whose ``qsort`` is not stable (musl, macOS, MSVC) may there write other
bytes than these and than glibc's llama.cpp. A NaN makes every
fit NaN (nothing adopted: the block is empty), whatever the order.

``nearest_int`` is written out as :func:`.ksearch.ni`'s bits, ``MAX`` as C's ``a > b ? a : b``. The float16 ``d``
is rounded by the caller (:func:`.ksearch.f16`); the kernel returns it as float32. Where llama.cpp aborts (a NaN
or infinite scale; no neighbour of finite error, only non-finite weights give that) the kernel writes bytes and
goes on: the first neighbour is taken, as the numpy path takes it. This module imports numpy, :mod:`.jit` and
:mod:`.kfloat` only (numba's disk cache is keyed on this file: MAGIC, read from :mod:`.kfloat`, is frozen into
cached kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from resumerge.outputs.gguf import jit
from resumerge.outputs.gguf import kfloat as kf

__all__ = ["Kernels", "kernels", "plain"]

_Array = np.ndarray


class Kernels(NamedTuple):
    """The kernel (compiled, or the plain function): ``encode``, documented below."""

    encode: Callable[[_Array, _Array, int, bool, tuple[_Array, _Array, _Array], _Array, _Array], None]


def _encode(block: _Array, qw: _Array, offset: int, medium: bool, tables: tuple[_Array, _Array, _Array],
            out: _Array, d: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as IQ1_S (or IQ1_M: ``medium``) into ``out`` (uint8 (B, 50 or
    56)), all but the float16 ``d`` (IQ1_S: bytes 0-1; IQ1_M: the top nibbles of its four scale words), whose
    float32 goes into ``d`` (B,) for the caller to round and place. Super-block b is weighted by row
    ``(offset + b) % len(qw)`` of ``qw`` (rows of 256), or (IQ1_M only) by x² where ``qw`` has no rows.
    ``tables``: :func:`.iq2grid.build`'s (``grid``, ``kmap``, ``neighbours``) of the 1-bit grid."""
    grid, kmap, neighbours = tables
    f32 = np.float32
    zero, one, half = f32(0.0), f32(1.0), f32(0.5)
    magic = kf.MAGIC
    biggest = f32(3.4028234663852886e38)  # FLT_MAX
    size = 16 if medium else 32
    blocks = 256 // size
    groups = size // 8
    eps = f32(1e-7) if medium else f32(1e-12)
    levels = np.empty((2, 3), dtype=np.float32)  # x_p (shift +DELTA), x_m (-DELTA)
    levels[0, 0], levels[0, 1], levels[0, 2] = f32(-0.875), f32(0.125), f32(1.125)
    levels[1, 0], levels[1, 1], levels[1, 2] = f32(-1.125), f32(-0.125), f32(0.875)
    masks = (0x00, 0x80, 0x08, 0x88)
    rows = qw.shape[0]
    weight = np.empty(256, dtype=np.float32)
    order = np.empty(size, dtype=np.int64)
    sumx = np.empty(size + 1, dtype=np.float32)
    sumw = np.empty(size + 1, dtype=np.float32)
    px = np.empty((2, size + 1), dtype=np.float32)  # IQ1_M: each half's prefix sums in the sorted order
    pw = np.empty((2, size + 1), dtype=np.float32)
    qx = np.empty((2, 2), dtype=np.float32)  # [shift, half]
    q2 = np.empty((2, 2), dtype=np.float32)
    gaps = np.empty((2, 2), dtype=np.float32)  # v0² - v1², v1² - v2² of each shift: exact
    for s in range(2):
        gaps[s, 0] = levels[s, 0] * levels[s, 0] - levels[s, 1] * levels[s, 1]
        gaps[s, 1] = levels[s, 1] * levels[s, 1] - levels[s, 2] * levels[s, 2]
    level = np.empty(size, dtype=np.int64)
    index = np.empty(groups, dtype=np.int64)
    scales = np.empty(blocks, dtype=np.float32)
    shifts = np.empty(blocks, dtype=np.int64)
    for b in range(block.shape[0]):
        x = block[b]
        o = out[b]
        o[:] = 0
        sumx2 = zero
        for e in range(256):
            sumx2 += x[e] * x[e]
        sigma2 = f32(2.0) * sumx2 / f32(256.0)
        for e in range(256):
            if rows > 0:
                weight[e] = qw[(offset + b) % rows, e] * np.sqrt(sigma2 + x[e] * x[e])
            else:
                weight[e] = x[e] * x[e]
        max_scale = zero
        for ib in range(blocks):
            base = size * ib
            top = abs(x[base])
            for i in range(1, size):
                a = abs(x[base + i])
                top = top if top > a else a
            scales[ib] = zero
            shifts[ib] = 0 if medium else 1
            if top < eps:
                continue
            for j in range(size):  # a stable sort (glibc's qsort: module docstring)
                order[j] = j
            for j in range(1, size):
                at = order[j]
                v = x[base + at]
                k = j - 1
                while k >= 0 and x[base + order[k]] > v:
                    order[k + 1] = order[k]
                    k -= 1
                order[k + 1] = at
            best = -biggest
            scale = top
            best1, best2, shift = -1, -1, 0
            if not medium:
                sumx[0], sumw[0] = zero, zero
                for j in range(size):
                    i = base + order[j]
                    sumx[j + 1] = sumx[j] + weight[i] * x[i]
                    sumw[j + 1] = sumw[j] + weight[i]
                for i1 in range(size + 1):
                    for i2 in range(i1, size + 1):
                        run0, run1, run2 = sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[size] - sumx[i2]
                        w0, w1, w2 = sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[size] - sumw[i2]
                        for s in range(2):
                            p0, p1, p2 = levels[s, 0], levels[s, 1], levels[s, 2]
                            sqx = run0 * p0 + run1 * p1 + run2 * p2
                            sq2 = w0 * p0 * p0 + w1 * p1 * p1 + w2 * p2 * p2
                            if sq2 > zero and sqx * sqx > best * sq2:
                                scale = sqx / sq2
                                best = scale * sqx
                                best1, best2, shift = i1, i2, 1 - 2 * s
            else:  # prefix sums per half of the block, each half its own shift (the pinned build's search)
                for h in range(2):
                    px[h, 0], pw[h, 0] = zero, zero
                for j in range(size):
                    i = order[j]
                    h = 0 if i < size // 2 else 1
                    px[h, j + 1] = px[h, j] + weight[base + i] * x[base + i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[base + i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                for i1 in range(size + 1):
                    for i2 in range(i1, size + 1):
                        for h in range(2):
                            sx = px[h, i1] + px[h, i2]
                            for s in range(2):  # v2 * total - (the two splits' prefixes): levels 1 apart
                                top2 = levels[s, 2]
                                qx[s, h] = px[h, size] * top2 - sx
                                q2[s, h] = (pw[h, size] * top2 * top2 + pw[h, i1] * gaps[s, 0]
                                            + pw[h, i2] * gaps[s, 1])
                        for k in range(4):  # combination k: the first half's shift (k < 2: +), the second's (even)
                            sqx = qx[k // 2, 0] + qx[k % 2, 1]
                            sq2 = q2[k // 2, 0] + q2[k % 2, 1]
                            if sq2 > zero and sqx * sqx > best * sq2:
                                scale = sqx / sq2
                                best = scale * sqx
                                best1, best2, shift = i1, i2, k
            if best1 < 0:  # nothing adopted (a NaN): the block is empty
                continue
            for j in range(size):
                level[order[j]] = 0 if j < best1 else (1 if j < best2 else 2)
            if scale < zero:
                for j in range(size):
                    level[j] = 2 - level[j]
                scale = -scale
                shift = 3 - shift if medium else -shift
            on_grid = True
            for k in range(groups):
                s = (shift // 2 if k == 0 else shift % 2) if medium else (1 - shift) // 2  # 0: +DELTA, 1: -DELTA
                key = 0
                for j in range(8):
                    key |= level[8 * k + j] << (2 * j)
                g = kmap[key]
                if g < 0:  # iq1_find_best_neighbour2 at this scale
                    on_grid = False
                    at = -g - 1
                    least = biggest
                    g = -1
                    for jj in range(1, neighbours[at] + 1):
                        candidate = neighbours[at + jj]
                        d2 = zero
                        for j in range(8):
                            diff = scale * levels[s, (grid[candidate, j] - 1) // 2] - x[base + 8 * k + j]
                            d2 += weight[base + 8 * k + j] * diff * diff
                        if d2 < least:
                            least = d2
                            g = candidate
                    if g < 0:  # llama.cpp aborts: only non-finite weights get here
                        g = neighbours[at + 1]
                index[k] = g
            if not on_grid:
                sqx, sq2 = zero, zero
                for k in range(groups):
                    s = (shift // 2 if k == 0 else shift % 2) if medium else (1 - shift) // 2  # 0: +DELTA, 1: -DELTA
                    for j in range(8):
                        w = weight[base + 8 * k + j]
                        q = levels[s, (grid[index[k], j] - 1) // 2]
                        sqx += w * q * x[base + 8 * k + j]
                        sq2 += w * q * q
                if sqx > zero and sq2 > zero:
                    scale = sqx / sq2
            if medium:
                o[2 * ib] = index[0] & 255
                o[2 * ib + 1] = index[1] & 255
                o[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            else:
                h = 0
                for k in range(4):
                    o[2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                o[34 + 2 * ib] = h & 255
                o[35 + 2 * ib] = h >> 8
            scales[ib] = scale
            shifts[ib] = shift
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == zero:
            d[b] = zero
            continue
        whole = max_scale / f32(15.0)
        inverse = one / whole
        if not medium:
            d[b] = whole * f32(1.125)
            for ib in range(blocks):
                p = half * (inverse * scales[ib] - one)
                q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000  # nearest_int
                q = 0 if q < 0 else (7 if q > 7 else q)
                if shifts[ib] == -1:
                    q |= 8
                o[35 + 2 * ib] |= q << 4
            continue
        sqx, sq2 = zero, zero
        for ib in range(blocks):
            p = half * (inverse * scales[ib] - one)
            q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000
            q = 0 if q < 0 else (7 if q > 7 else q)
            word = (q << (3 * (ib % 4))) & 0xFFFF
            o[48 + 2 * (ib // 4)] |= word & 255
            o[49 + 2 * (ib // 4)] |= word >> 8
            o[32 + ib] |= masks[shifts[ib]]
            odd = f32(2 * q + 1)
            base = size * ib
            for k in range(2):
                s = shifts[ib] // 2 if k == 0 else shifts[ib] % 2
                g = o[2 * ib + k] | ((np.int64(o[32 + ib]) << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    w = weight[base + 8 * k + j]
                    value = levels[s, (grid[g, j] - 1) // 2] * odd
                    sqx += w * value * x[base + 8 * k + j]
                    sq2 += w * value * value
        if sq2 > zero:
            whole = sqx / sq2
        d[b] = whole * f32(1.1125)


kernels = jit.lazy_kernels(Kernels, _encode)
# the same function uncompiled: the reference the tests hold both paths to (too slow for a model)
plain = Kernels(_encode)
