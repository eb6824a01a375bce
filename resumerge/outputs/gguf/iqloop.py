"""The compiled twin of :mod:`.iquants`' numpy path (IQ4_NL, IQ4_XS): each block's scale search and the final
codes, as loops numba compiles (:mod:`.jit`), to the same bits.

The numpy path runs each of a candidate's steps as one call over all blocks; these kernels run llama.cpp's scalar
loop block by block, the same float32 operations in the same order (numba types float32 with float32 as float32,
and every constant here is float32): the super-block's mean square summed from 0 in index order, each weight one
product and one root, each candidate's sums in index order, adopted on the same strict comparisons. The nearest
level is ``best_index_int8``'s: the level just above found from ``floor`` through a table rather than by bisection
(the same index: the levels are integers), the same float32 comparison between its two neighbours taken as a
select rather than a branch (half go each way: as a branch it mispredicted, half the kernel's time, measured with
bench/bench_kquants.py), NaN and values past the ends as C's comparisons take them.

This module imports numpy, :mod:`.jit` and :mod:`.kfloat` only; numba itself is imported by :mod:`.jit` on the first
:func:`kernels` call, never at resumerge's import. Where numba is missing :func:`kernels` is None and
:mod:`.iquants` takes its numpy path. (numba's disk cache is keyed on this file: EPS, read from :mod:`.kfloat`, is
frozen into the cached kernels, so a change to it there needs a change here too.)
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
    """The compiled kernels (each documented at its plain function below: ``_search``, ``_codes``)."""

    search: Callable[[_Array, _Array, int, _Array, _Array, _Array], None]
    codes: Callable[[_Array, _Array, _Array, _Array, _Array], None]


def _search(block: _Array, qw: _Array, offset: int, levels: _Array, above: _Array, scales: _Array) -> None:
    """Each 32-value block's scale of super-blocks ``block`` (float32 (B, n)) into ``scales`` (float32 (B,
    n/32)): super-block b weighted by row ``(offset + b) % len(qw)`` of ``qw`` (rows of n), or by x² where
    ``qw`` has no rows. ``levels``: the 16 levels (float32); ``above``: ``floor(v) + 127`` -> the index of the
    first level above v, for v within the levels."""
    f32 = np.float32
    zero, one = f32(0.0), f32(1.0)
    low, high = levels[0], levels[15]
    eps = kf.EPS
    supers, n = block.shape
    rows = qw.shape[0]
    factor = f32(2.0) / f32(n)
    w = np.empty(n, dtype=np.float32)
    for b in range(supers):
        x = block[b]
        if rows > 0:
            sigma2 = zero
            for e in range(n):
                sigma2 += x[e] * x[e]
            sigma2 = sigma2 * factor
            weights = qw[(offset + b) % rows]
            for e in range(n):
                w[e] = weights[e] * np.sqrt(sigma2 + x[e] * x[e])
        else:
            for e in range(n):
                w[e] = x[e] * x[e]
        for ib in range(n // 32):
            at = 32 * ib
            amax, peak = zero, zero
            for j in range(32):
                a = abs(x[at + j])
                if a > amax:
                    amax, peak = a, x[at + j]
            if amax < eps:
                scales[b, ib] = zero
                continue
            d = -peak / low
            best = zero
            for k in range(-8, 8):  # -8: the start, from the largest value's own scale
                inverse = one / d if k == -8 else f32(k - 127) / peak
                sumqx, sumq2 = zero, zero
                for j in range(32):
                    xv = x[at + j]
                    v = inverse * xv
                    if v <= low:
                        q = low
                    elif not v < high:  # NaN too, as C's bisection ends there
                        q = high
                    else:  # the lower neighbour where nearer (a select, not a branch: half of them go each way)
                        up = above[int(np.floor(v)) + 127]
                        q = levels[up - np.intp(v - levels[up - 1] < levels[up] - v)]
                    wq = w[at + j] * q
                    sumqx += wq * xv
                    sumq2 += wq * q
                if k == -8:
                    d = sumqx / sumq2 if sumq2 > zero else zero
                    best = d * sumqx
                elif sumq2 > zero and sumqx * sumqx > best * sumq2:
                    d = sumqx / sumq2
                    best = d * sumqx
            scales[b, ib] = d


def _codes(block: _Array, inverse: _Array, levels: _Array, above: _Array, out: _Array) -> None:
    """The level indices of super-blocks ``block`` (float32 (B, n)) scaled by each 32-value block's ``inverse``
    (float32 (B, n/32)) into ``out`` (uint8 (B, n)); ``levels`` and ``above`` as :func:`_search`'s."""
    low, high = levels[0], levels[15]
    supers, n = block.shape
    for b in range(supers):
        for ib in range(n // 32):
            scale = inverse[b, ib]
            for j in range(32 * ib, 32 * ib + 32):
                v = scale * block[b, j]
                if v <= low:
                    out[b, j] = 0
                elif not v < high:
                    out[b, j] = 15
                else:
                    up = above[int(np.floor(v)) + 127]
                    out[b, j] = up - np.intp(v - levels[up - 1] < levels[up] - v)


kernels = jit.lazy_kernels(Kernels, _search, _codes)
