"""The compiled twin of :mod:`.iq3quants`' numpy path (IQ3_XXS, IQ3_S): llama.cpp's scalar loop over each 32-value
block, as numba compiles it (:mod:`.jit`), to the same bits.

The same float32 operations in the same order as ``quantize_row_iq3_xxs_impl`` / ``quantize_row_iq3_s_impl``: the
super-block's mean square summed from 0 in index order, each weight one product and one root (and its root for the
neighbour search), each candidate's codes rounded with ``nearest_int``'s bits (the magic constant, exact at any
argument), its off-grid quadruples resolved through the neighbour lists in their order on a strict improvement of
the weighted error, its sums in index order, adopted on the same strict comparisons; C's ``MAX`` as written (a
comparison and a select). One kernel encodes both types (``xxs``): they differ in the candidates tried (31 or 19),
the empty block's test (max under 1e-8, or exactly 0), IQ3_XXS's even sign parity (the smallest weighted square
flipped), which quadruples the refinement revisits (the off-grid ones, or all), and the layout.

Where llama.cpp's quantizer aborts (a NaN scale, or every neighbour's error NaN or infinite, which only non-finite
weights give), these kernels write bytes and go on: the first neighbour is taken, as the numpy path takes it.

This module imports numpy, :mod:`.jit` and :mod:`.kfloat` only; numba itself is imported by :mod:`.jit` on the first
:func:`kernels` call. (numba's disk cache is keyed on this file: MAGIC, read from :mod:`.kfloat`, is frozen into the
cached kernels.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from resumerge.outputs.gguf import jit
from resumerge.outputs.gguf import kfloat as kf

__all__ = ["Kernels", "kernels"]

_Array = np.ndarray


class Kernels(NamedTuple):
    """The compiled kernel (documented at its plain function below, ``_encode``)."""

    encode: Callable[[_Array, _Array, int, bool, _Array, _Array, _Array, _Array, _Array, _Array], None]


def _encode(block: _Array, qw: _Array, offset: int, xxs: bool, odd: _Array, levels: _Array, kmap: _Array,
            flat: _Array, out: _Array, d: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as IQ3_XXS (``xxs``) or IQ3_S bytes into ``out`` (uint8 (B, 98 or
    110)), all but the float16 ``d``, whose float32 (``max_scale / 31`` times the type's fudge factor) goes into
    ``d`` (B,) for the caller to round. Super-block b is weighted by row ``(offset + b) % len(qw)`` of ``qw`` (rows
    of 256), or by x² where ``qw`` has no rows. ``odd``, ``levels``, ``kmap``, ``flat``: the grid's magnitudes,
    levels and neighbour map (:class:`.iq3neighbours.Neighbours`)."""
    f32 = np.float32
    zero, one, half = f32(0.0), f32(1.0), f32(0.5)
    magic = kf.MAGIC
    biggest = f32(3.4028234663852886e38)  # FLT_MAX
    ntry = 15 if xxs else 9
    nsteps = 2 * ntry + 1
    supers = block.shape[0]
    rows = qw.shape[0]
    weight = np.empty(256, dtype=np.float32)
    waux = np.empty(256, dtype=np.float32)
    xval = np.empty(32, dtype=np.float32)
    codes = np.zeros(32, dtype=np.int32)
    trial = np.zeros(32, dtype=np.int32)
    on = np.zeros(8, dtype=np.bool_)
    on_trial = np.zeros(8, dtype=np.bool_)
    signs = np.zeros(4, dtype=np.int32)
    scales = np.zeros(8, dtype=np.float32)
    for b in range(supers):
        x = block[b]
        o = out[b]
        o[:] = 0
        sumx2 = zero
        for e in range(256):
            sumx2 += x[e] * x[e]
        sigma2 = f32(2.0) * sumx2 / f32(256.0)
        if rows > 0:
            weights = qw[(offset + b) % rows]
            for e in range(256):
                weight[e] = weights[e] * np.sqrt(sigma2 + x[e] * x[e])
        else:
            for e in range(256):
                weight[e] = x[e] * x[e]
        for e in range(256):
            waux[e] = np.sqrt(weight[e])
        max_scale = zero
        written = 0  # IQ3_S's blocks written so far: an empty block does not move its codes' and signs' place
        for ib in range(8):
            at = 32 * ib
            for k in range(4):
                s = 0
                flips = 0
                for i in range(8):
                    v = x[at + 8 * k + i]
                    if v >= zero:
                        xval[8 * k + i] = v
                    else:
                        xval[8 * k + i] = -v
                        flips += 1
                        s |= 1 << i
                if xxs and flips % 2 == 1:  # an even count of minus signs: the least weighted square's flipped
                    imin = 0
                    least = weight[at + 8 * k] * x[at + 8 * k] * x[at + 8 * k]
                    for i in range(1, 8):
                        a = weight[at + 8 * k + i] * x[at + 8 * k + i] * x[at + 8 * k + i]
                        if a < least:
                            least = a
                            imin = i
                    xval[8 * k + imin] = -xval[8 * k + imin]
                    s ^= 1 << imin
                signs[k] = s & 127 if xxs else s
            top = xval[0]
            for i in range(1, 32):
                top = top if top > xval[i] else xval[i]
            for i in range(32):
                codes[i] = 0
            if (xxs and top < f32(1e-8)) or (not xxs and top == zero):
                scales[ib] = zero
                continue
            best = zero
            scale = top / f32(15.0)
            for k in range(8):
                on[k] = xxs
            for step in range(nsteps + 1):
                refine = step == nsteps
                if refine:
                    missing = 0
                    for k in range(8):
                        if not on[k]:
                            missing += 1
                    if missing == 0 or not scale > zero:
                        break
                    inverse = one / scale
                    near_scale = scale
                    for i in range(32):
                        trial[i] = codes[i]
                else:
                    inverse = (f32(15.0) + f32(step - ntry) * f32(0.2)) / top
                    near_scale = one / inverse
                for k in range(8):
                    if refine and xxs and on[k]:
                        continue
                    u = 0
                    for i in range(4):
                        p = half * (inverse * xval[4 * k + i] - one)
                        q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000  # nearest_int
                        q = 0 if q < 0 else (7 if q > 7 else q)
                        trial[4 * k + i] = q
                        u |= q << (3 * i)
                    g = kmap[u]
                    on_trial[k] = g >= 0
                    if g < 0:
                        start = -g - 1
                        least = biggest
                        g = -1
                        for j in range(flat[start]):
                            point = flat[start + 1 + j]
                            d2 = zero
                            for i in range(4):
                                diff = near_scale * odd[point, i] - xval[4 * k + i]
                                d2 += waux[at + 4 * k + i] * diff * diff
                            if d2 < least:
                                least = d2
                                g = point
                        if g < 0:  # llama.cpp aborts: only non-finite weights get here
                            g = flat[start + 1]
                        for i in range(4):
                            trial[4 * k + i] = levels[g, i]
                sumqx, sumq2 = zero, zero
                for i in range(32):
                    w = weight[at + i]
                    m = f32(2 * trial[i] + 1)
                    sumqx += w * xval[i] * m
                    sumq2 += w * m * m
                if refine:
                    for i in range(32):
                        codes[i] = trial[i]
                    if sumq2 > zero:
                        scale = sumqx / sumq2
                elif sumq2 > zero and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    for i in range(32):
                        codes[i] = trial[i]
                    for k in range(8):
                        on[k] = on_trial[k]
            if scale < zero:
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & (127 if xxs else 255)
            for k in range(8):
                g = kmap[codes[4 * k] | (codes[4 * k + 1] << 3) | (codes[4 * k + 2] << 6) | (codes[4 * k + 3] << 9)]
                if xxs:
                    o[2 + 8 * ib + k] = g
                else:
                    o[2 + 8 * written + k] = g & 255
                    o[66 + ib] |= (g >> 8) << k
            if xxs:
                word = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                for j in range(4):
                    o[66 + 4 * ib + j] = (word >> (8 * j)) & 255
            else:
                for k in range(4):
                    o[74 + 4 * written + k] = signs[k]
                written += 1
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if xxs and max_scale == zero:  # llama.cpp clears the codes and signs
            o[:] = 0
            d[b] = zero
            continue
        if max_scale == zero:
            d[b] = zero
            continue
        sub = max_scale / f32(31.0)
        d[b] = sub * (f32(1.0125) if xxs else f32(1.033))
        inverse = one / sub
        for ib in range(8):
            p = half * (inverse * scales[ib] - one)
            q = (np.float32(p + magic).view(np.int32) & 0x7FFFFF) - 0x400000
            q = 0 if q < 0 else (15 if q > 15 else q)
            if xxs:
                o[66 + 4 * ib + 3] |= q << 4
            else:
                o[106 + ib // 2] |= q << (4 * (ib % 2))


kernels = jit.lazy_kernels(Kernels, _encode)
