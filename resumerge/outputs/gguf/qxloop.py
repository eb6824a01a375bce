"""The compiled twin of :mod:`.ksearch`'s symmetric searches (``qx_lazy``/``qx``, ``q3``, ``qp``): the same float32
operations in the same order, as loops numba compiles (:mod:`.jit`), to the same bits.

Each loop runs over rows of sub-blocks, ``for i in range(n): for s in range(S):`` on the element-major (n, S)
arrays, with one accumulator per sub-block, so LLVM vectorises across sub-blocks while each sum still adds its
terms in index order, from 0 as :func:`.ksearch.fsum` does. The float32 ends are the numpy path's: ``nearest_int``
is computed exactly as :func:`.ksearch.ni` (its bits, branch-free, written out in each loop that takes it),
wherever the numpy path takes it; C's scans (``>`` from 0, ``MAX``) are written as C writes them (the
largest-magnitude scan once, :func:`_largest`, a helper the kernels call: :mod:`.jit`), which is what
:func:`.ksearch.largest` and :func:`.ksearch.scan_max` reproduce with reductions. The coordinate descent runs
every live sub-block's pass together, five at most: a pass that changes nothing in a sub-block leaves its sums and
codes as they were, so the passes it takes after converging change nothing (the argument :func:`.ksearch.descend`
rests on too).

This module imports numpy, :mod:`.jit` and :mod:`.kfloat` (the constants it shares with :mod:`.ksearch`) only;
numba itself is imported by :mod:`.jit` on the first :func:`kernels` call, never at resumerge's import. Where numba
is missing, :func:`kernels` is None and :mod:`.ksearch` takes its numpy path, to the same bytes. (numba's disk cache
is keyed on this file: the constants read from :mod:`.kfloat`, EPS, MAGIC and TAME, are frozen into the cached
kernels, so a change to them there needs a change here too.)
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
    """The compiled searches (each documented at its plain function below: ``_qx``, ``_descend``, ``_qp_start``)."""

    qx: Callable[[_Array, _Array, int, bool], tuple[_Array, _Array, _Array, bool]]
    descend: Callable[[_Array, _Array, _Array, float, float, bool, bool], tuple[_Array, _Array]]
    qp_start: Callable[[_Array, _Array, int], tuple[_Array, _Array]]
    q3_start: Callable[[_Array, int], tuple[_Array, _Array]]


def _largest(x: _Array) -> tuple[_Array, _Array]:
    """Each column of ``x`` (n, S)'s largest magnitude and the value that has it, by C's scan: ``if (ax > amax)``
    from 0 (a NaN is never taken; the first of equal magnitudes is kept)."""
    n, width = x.shape
    amax = np.zeros(width, np.float32)
    peak = np.zeros(width, np.float32)
    for i in range(n):
        for s in range(width):
            v = x[i, s]
            a = abs(v)
            if a > amax[s]:
                amax[s] = a
                peak[s] = v
    return amax, peak


def _qx(x: _Array, w: _Array, nmax: int, squares: bool) -> tuple[_Array, _Array, _Array, bool]:
    """:func:`.ksearch.qx_lazy`'s search of each column of ``x`` (n, S), its weights ``w`` (n, S), or ``x·x`` where
    ``squares`` (``w`` then unread): (the scale, 0 in an all-zero column; the adopted inverse scale; whether the
    column is all zero; whether every candidate's products are within nearest_int's exact range, as the numpy
    path decides between ``np.rint`` and :func:`.ksearch.ni`, which round the same there)."""
    n, width = x.shape
    f32 = np.float32
    amax, peak = _largest(x)
    zero = np.empty(width, np.bool_)
    in_range = True
    for s in range(width):
        zero[s] = not amax[s] >= kf.EPS
        if zero[s]:
            peak[s] = f32(1)
        if not f32(nmax + 1) / abs(peak[s]) * amax[s] <= kf.TAME:
            in_range = False
    low, high = f32(-nmax), f32(nmax - 1)
    chosen = np.empty(width, f32)
    iscale = np.empty(width, f32)
    scale = np.empty(width, f32)
    best = np.empty(width, f32)
    sumlx = np.empty(width, f32)
    suml2 = np.empty(width, f32)
    for k in range(19):  # the starting candidate, then steps -9..-1 and 1..9
        at = 0 if k == 0 else k - 10 if k < 10 else k - 9
        if at == 0:
            for s in range(width):
                iscale[s] = f32(-nmax) / peak[s]
        else:
            numerator = -(f32(nmax) + f32(0.1) * f32(at))
            for s in range(width):
                iscale[s] = numerator / peak[s]
        sumlx[:] = 0
        suml2[:] = 0
        for i in range(n):
            for s in range(width):
                v = x[i, s]
                p = iscale[s] * v
                # np.rint where every product is in nearest_int's exact range (measured: a third less time than
                # ksearch.ni throughout), else ksearch.ni: the mantissa of p + 1.5·2^23, less 2^22
                q = np.rint(p) if in_range else f32((np.float32(p + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)
                q = low if q < low else q
                q = high if q > high else q
                wv = v * v if squares else w[i, s]
                sumlx[s] += wv * v * q
                suml2[s] += wv * q * q
        if at == 0:
            for s in range(width):
                chosen[s] = iscale[s]
                scale[s] = sumlx[s] / suml2[s] if suml2[s] != 0 else f32(0)
                best[s] = scale[s] * sumlx[s]
        else:
            for s in range(width):
                if sumlx[s] * sumlx[s] > best[s] * suml2[s] and suml2[s] > 0:
                    chosen[s] = iscale[s]
                    scale[s] = sumlx[s] / suml2[s]
                    best[s] = scale[s] * sumlx[s]
    for s in range(width):
        if zero[s]:
            scale[s] = 0
    return scale, chosen, zero, in_range


def _descend(x: _Array, w: _Array, q: _Array, low: float, high: float, need_sl2: bool,
             squares: bool) -> tuple[_Array, _Array]:
    """:func:`.ksearch.descend` from the codes ``q`` (n, S; in place) of ``x`` weighted by ``w``, or by ``x·x``
    where ``squares`` (``w`` then unread), its starting sums taken here (Σ wx·q and Σ w·q·q from 0): the final
    (Σwxq, Σwq²). A pass tries each position in turn in every column, as the scalar loop does in one; a column's
    pass that changes nothing would change nothing again, so every column takes every pass until one changes no
    column, or five."""
    n, width = x.shape
    f32 = np.float32
    lo, hi = f32(low), f32(high)
    sumlx = np.zeros(width, f32)
    suml2 = np.zeros(width, f32)
    for i in range(n):
        for s in range(width):
            wv = x[i, s] * x[i, s] if squares else w[i, s]
            sumlx[s] += wv * x[i, s] * q[i, s]
            suml2[s] += wv * q[i, s] * q[i, s]
    for _ in range(5):
        changed = 0
        for i in range(n):
            for s in range(width):
                v = x[i, s]
                wv = v * v if squares else w[i, s]
                wx = wv * v
                was = q[i, s]
                lx = sumlx[s]
                l2 = suml2[s]
                slx = lx - wx * was
                sl2 = l2 - wv * was * was
                tried = slx > 0 and sl2 > 0 if need_sl2 else slx > 0
                new = v * sl2 / slx
                new = f32((np.float32(new + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)  # ksearch.ni
                new = lo if new < lo else new
                new = hi if new > hi else new
                slx += wx * new
                sl2 += wv * new * new
                keep = tried and new != was and slx * slx * l2 > lx * lx * sl2 and (need_sl2 or sl2 > 0)
                if keep:
                    q[i, s] = new
                    sumlx[s] = slx
                    suml2[s] = sl2
                    changed += 1
        if changed == 0:
            break
    return sumlx, suml2


def _qp_start(x: _Array, w: _Array, nmax: int) -> tuple[_Array, _Array]:
    """:func:`.ksearch.qp`'s candidates before its descent, for each column of ``x`` (n, S) weighted by ``w``:
    (whether the column's largest value is under EPS, the adopted candidate's codes as the uint8 C stores)."""
    n, width = x.shape
    f32 = np.float32
    top = f32(nmax)
    peak = np.zeros(width, f32)
    for i in range(n):  # C's MAX scan from 0 (ksearch.scan_max)
        for s in range(width):
            v = x[i, s]
            peak[s] = peak[s] if peak[s] > v else v
    zero = np.empty(width, np.bool_)
    iscale = np.empty(width, f32)
    trial = np.empty(width, f32)
    scale = np.empty(width, f32)
    best = np.zeros(width, f32)
    mse = np.empty(width, f32)
    for s in range(width):
        zero[s] = peak[s] < kf.EPS
        if zero[s]:
            peak[s] = f32(1)
        iscale[s] = top / peak[s]
        scale[s] = f32(1) / iscale[s]
    for i in range(n):
        for s in range(width):
            v = x[i, s]
            q = f32((np.float32(iscale[s] * v + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)  # ksearch.ni
            q = q + f32(256) if q < 0 else q  # stored in a uint8 before its error is taken
            diff = v - scale[s] * q
            best[s] += w[i, s] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        numerator = f32(0.1) * f32(step) + top
        for s in range(width):
            trial[s] = numerator / peak[s]
            scale[s] = f32(1) / trial[s]
        mse[:] = 0
        for i in range(n):
            for s in range(width):
                v = x[i, s]
                q = f32((np.float32(trial[s] * v + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)
                q = top if top < q else q
                diff = v - scale[s] * q
                mse[s] += w[i, s] * diff * diff
        for s in range(width):
            if mse[s] < best[s]:
                best[s] = mse[s]
                iscale[s] = trial[s]
    codes = np.empty_like(x)
    for i in range(n):
        for s in range(width):
            q = f32((np.float32(iscale[s] * x[i, s] + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)
            q = top if top < q else q
            codes[i, s] = q + f32(256) if q < 0 else q  # stored in a uint8
    return zero, codes


def _q3_start(x: _Array, nmax: int) -> tuple[_Array, _Array]:
    """:func:`.ksearch.q3`'s codes before its descent, for each column of ``x`` (n, S): (whether the column is all
    zero, the codes of ``-nmax`` over its first value of largest magnitude, within -nmax..nmax-1)."""
    n, width = x.shape
    f32 = np.float32
    amax, peak = _largest(x)
    zero = np.empty(width, np.bool_)
    iscale = np.empty(width, f32)
    in_range = True
    for s in range(width):
        zero[s] = not amax[s] >= kf.EPS
        iscale[s] = f32(-nmax) / (f32(1) if zero[s] else peak[s])
        if not abs(iscale[s]) * amax[s] <= kf.TAME:
            in_range = False
    low, high = f32(-nmax), f32(nmax - 1)
    codes = np.empty_like(x)
    for i in range(n):
        for s in range(width):
            p = iscale[s] * x[i, s]
            q = np.rint(p) if in_range else f32((np.float32(p + kf.MAGIC).view(np.int32) & 0x7FFFFF) - 0x400000)
            q = low if q < low else q
            codes[i, s] = high if q > high else q
    return zero, codes


# The compiled kernels, or None where numba is not there (checked on each call: a test that takes numba away takes
# these too).
kernels = jit.lazy_kernels(Kernels, _qx, _descend, _qp_start, _q3_start, helpers=(_largest,))
