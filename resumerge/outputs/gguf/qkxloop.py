"""``make_qkx2_quants``/``make_qkx3_quants`` compiled: the twin of :func:`.ksearch.qkx_numpy`, which
:func:`.ksearch.qkx` takes where numba is installed (:mod:`.jit`), writing its every scale, min and code bit.

The numpy path runs each float32 step of the search as one call over all sub-blocks; this kernel runs the same
steps, in the same operations and order, fused over blocks of sub-blocks (columns of the element-major ``(n,
S)`` arrays, a block's values staying in the first-level cache over every candidate): loops ``for i in range(n):
for j in range(block)`` that LLVM vectorises across sub-blocks, each sum accumulated per sub-block in index order
as ``fsum`` does, C's ``nearest_int`` as ``np.rint``, the clamp as ``np.clip`` (``-0.0`` kept).

A sub-block whose result could differ from numpy's is left to numpy (its index returned): a value or weight not
finite, a candidate whose grid's nearest_int arguments may leave the range where they are ``np.rint`` (the numpy
path's :func:`.ksearch.tame` bound, per sub-block), or a scale or min that is NaN (whose bits this kernel's
operand order need not keep). A flat sub-block's result is its min alone (scale and codes 0), so its candidates
are neither bounded nor adopted. Once one column's argument may leave the range, the numpy path rounds every
column with nearest_int's bits, which differ from ``np.rint`` in range only for a -0 product (+0): only the
final codes show it, so those are then made +0 as numpy's are. The min and max of each sub-block are numpy's
own reductions (their signed zeros are numpy's SIMD order's).

Imports numpy, :mod:`.jit` and :mod:`.kfloat` only: the numpy path is passed in by :mod:`.ksearch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from resumerge.outputs.gguf import jit
from resumerge.outputs.gguf import kfloat as kf

__all__ = ["qkx"]

_Array = np.ndarray
_Result = tuple[_Array, _Array, _Array]
_Rest = tuple[_Array, _Array, _Array, bool]
# sub-blocks searched together: a block's values, weights and codes (3 x 32 x 64 float32) stay in the first-level
# cache over all of a search's candidates (blocks of 32 to 2048 measured the same on 2048 sub-blocks)
_BLOCK = 64


def _level(xv: float, low: float, iscale: float, top: float) -> float:
    """A value's code on a candidate's grid (its min ``low``, inverse scale ``iscale``): ``(xv - low) * iscale``
    clamped to 0 ... ``top`` (``-0.0`` kept, as ``np.clip`` keeps it), then ``np.rint``."""
    zero = np.float32(0)
    v = (xv - low) * iscale
    if v < zero:
        v = zero
    elif v > top:
        v = top
    return np.rint(v)  # type: ignore[no-any-return]


def _search(x: _Array, w: _Array, bounds: tuple[_Array, _Array], ladder: tuple[int, float, float, int],
            flags: tuple[bool, bool, float], scale: _Array, offset: _Array, codes: _Array, left: _Array,
            wrapped: _Array) -> None:
    """The search of :func:`.ksearch.qkx_numpy` over ``x``, ``w`` (n, S) with each column's min ``lo`` and max
    ``hi`` (``bounds``), its candidates' ``ladder`` (nmax, rmin, rdelta, nstep) and ``flags`` (mad, v3, tame: the
    bound), into ``scale``, ``offset`` (S,) and ``codes`` (n, S); ``left`` (S,) set where numpy must take the
    column (module docstring); ``wrapped[0]`` set where a flat column's final grid is past the bound (numpy then
    rounds every column's codes with nearest_int's bits). Compiled by numba; every float32 operation as the numpy
    path's, in its order."""
    lo, hi = bounds
    nmax, rmin, rdelta, nstep = ladder
    mad, v3, tame = flags
    n, width = x.shape
    zero, one, top, bound = np.float32(0), np.float32(1), np.float32(nmax), np.float32(tame)
    size = _BLOCK
    sum_w = np.empty(size, np.float32)
    sum_x = np.empty(size, np.float32)
    guard = np.empty(size, np.float32)
    reach = np.empty(size, np.float32)
    low = np.empty(size, np.float32)
    span = np.empty(size, np.float32)
    extent = np.empty(size, np.float32)
    best = np.empty(size, np.float32)
    iscale = np.empty(size, np.float32)
    chosen = np.empty(size, np.float32)
    anchor = np.empty(size, np.float32)
    step_scale = np.empty(size, np.float32)
    sum_l = np.empty(size, np.float32)
    sum_xl = np.empty(size, np.float32)
    sum_l2 = np.empty(size, np.float32)
    fit = np.empty(size, np.float32)
    this_scale = np.empty(size, np.float32)
    this_min = np.empty(size, np.float32)
    current = np.empty(size, np.float32)
    live = np.empty(size, np.bool_)
    q = np.empty((n, size), np.float32)
    for start in range(0, width, size):
        m = min(size, width - start)
        # unsigned indices: numba wraps a negative index, and a signed sum it cannot prove non-negative costs a
        # select on every access that stops the loops' vectorisation (6x slower measured)
        base = np.uint64(start)
        # the sums from each column's first element (fsum_first); guard: 0 where every value and weight is
        # finite (v - v is NaN for inf and NaN)
        for j in range(m):
            c = base + np.uint64(j)
            xv, wv = x[0, c], w[0, c]
            sum_w[j] = wv
            sum_x[j] = wv * xv
            guard[j] = (xv - xv) + (wv - wv)
        for i in range(1, n):
            for j in range(m):
                c = base + np.uint64(j)
                xv, wv = x[i, c], w[i, c]
                sum_w[j] += wv
                sum_x[j] += wv * xv
                guard[j] += (xv - xv) + (wv - wv)
        for j in range(m):
            c = base + np.uint64(j)
            left[c] = guard[j] != zero
            a, b = lo[c], hi[c]
            reach[j] = b if b > -a else -a  # only ever bounded, so which signed zero is moot
            if a > zero:
                a = zero
            flat = b <= a if v3 else b == a
            live[j] = not flat
            span[j] = one if flat else b - a
            low[j] = a
            iscale[j] = top / span[j]
            step_scale[j] = one / iscale[j]
            extent[j] = reach[j] + abs(a)
            if live[j] and not abs(iscale[j]) * extent[j] <= bound:
                left[c] = True
            chosen[j] = iscale[j]
            anchor[j] = a
            best[j] = zero
        # the first candidate: the min and max's own grid, its error against its scale
        for i in range(n):
            for j in range(m):
                c = base + np.uint64(j)
                xv = x[i, c]
                v = _level(xv, low[j], iscale[j], top)
                d = step_scale[j] * v + low[j] - xv
                d = abs(d) if mad else d * d
                best[j] += d * w[i, c]
        for step in range(nstep + 1):
            numerator = np.float32(rmin) + np.float32(rdelta) * np.float32(step) + top
            for j in range(m):
                c = base + np.uint64(j)
                iscale[j] = numerator / span[j]
                left[c] |= live[j] & ~(abs(iscale[j]) * extent[j] <= bound)
                sum_l[j] = zero
                sum_xl[j] = zero
                sum_l2[j] = zero
                current[j] = zero
            for i in range(n):
                for j in range(m):
                    c = base + np.uint64(j)
                    xv = x[i, c]
                    v = _level(xv, low[j], iscale[j], top)
                    q[i, j] = v
                    t = w[i, c] * v
                    sum_l[j] += t
                    sum_xl[j] += t * xv
                    sum_l2[j] += t * v
            for j in range(m):
                fit[j] = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j]  # det
                this_scale[j] = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / fit[j]
                this_min[j] = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / fit[j]
                positive = this_min[j] > zero
                this_min[j] = zero if positive else this_min[j]
                this_scale[j] = sum_xl[j] / sum_l2[j] if positive else this_scale[j]
            if mad:
                for i in range(n):
                    for j in range(m):
                        c = base + np.uint64(j)
                        d = this_scale[j] * q[i, j] + this_min[j] - x[i, c]
                        current[j] += abs(d) * w[i, c]
            else:
                for i in range(n):
                    for j in range(m):
                        c = base + np.uint64(j)
                        d = this_scale[j] * q[i, j] + this_min[j] - x[i, c]
                        current[j] += d * d * w[i, c]
            for j in range(m):
                c = base + np.uint64(j)
                better = (current[j] < best[j]) & (fit[j] > zero) & live[j]
                chosen[j] = iscale[j] if better else chosen[j]
                anchor[j] = low[j] if better else anchor[j]
                best[j] = current[j] if better else best[j]
                step_scale[j] = this_scale[j] if better else step_scale[j]
                low[j] = this_min[j] if better else low[j]
                span[j] = hi[c] - low[j] if better else span[j]
                extent[j] = reach[j] + abs(low[j])
        # the adopted candidate's codes, from its grid; a flat column's are 0
        for j in range(m):
            c = base + np.uint64(j)
            if not abs(chosen[j]) * (reach[j] + abs(anchor[j])) <= bound:
                if live[j]:
                    left[c] = True
                elif not left[c]:
                    wrapped[0] = True
        for i in range(n):
            for j in range(m):
                c = base + np.uint64(j)
                codes[i, c] = _level(x[i, c], anchor[j], chosen[j], top) if live[j] else zero
        for j in range(m):
            c = base + np.uint64(j)
            scale[c] = step_scale[j] if live[j] else zero
            offset[c] = -low[j]
            if scale[c] != scale[c] or offset[c] != offset[c]:
                left[c] = True


class _Kernels(NamedTuple):
    search: Callable[..., None]


_compiled = jit.lazy_kernels(_Kernels, _search, helpers=(_level,))


def _kernel() -> Callable[..., Any] | None:
    """:func:`_search` compiled, or None where numba is not there (checked on each call, as :mod:`.qxloop`'s)."""
    found = _compiled()
    return None if found is None else found.search


def qkx(x: _Array, w: _Array, nmax: int, rmin: float, rdelta: float, nstep: int, *, mad: bool, v3: bool,
        rest: Callable[..., _Rest]) -> _Result | None:
    """:func:`.ksearch.qkx_numpy`'s (scale, min as an offset, codes) of ``x``, ``w`` (n, S), compiled, with
    ``rest`` (that function, telling whether it rounded its codes with nearest_int's bits) for the columns the
    kernel leaves (past :data:`.kfloat.TAME`, the numpy path's bound); None where there is no kernel, or the arrays
    are not what it takes (float32, C-contiguous, (n, S) with n and S positive)."""
    kernel = _kernel()
    if (kernel is None or x.ndim != 2 or x.shape != w.shape or x.shape[0] == 0 or x.shape[1] == 0
            or x.dtype != np.float32 or w.dtype != np.float32
            or not (x.flags.c_contiguous and w.flags.c_contiguous)):
        return None
    width = x.shape[1]
    scale, offset = np.empty(width, dtype=np.float32), np.empty(width, dtype=np.float32)
    codes = np.empty_like(x)
    left = np.zeros(width, dtype=np.bool_)
    wrapped = np.zeros(1, dtype=np.bool_)
    kernel(x, w, (x.min(axis=0), x.max(axis=0)), (int(nmax), float(rmin), float(rdelta), int(nstep)),
           (bool(mad), bool(v3), kf.TAME), scale, offset, codes, left, wrapped)
    at = np.flatnonzero(left)
    if at.size:
        # numpy's results for these columns are the same searched apart (each column's steps are its own, and
        # nearest_int is np.rint where its argument is in range, but for a -0 product, which it makes +0: only
        # the final codes show it, below)
        part = rest(np.ascontiguousarray(x[:, at]), np.ascontiguousarray(w[:, at]), nmax, rmin, rdelta, nstep,
                    mad=mad, v3=v3)
        scale[at], offset[at], codes[:, at] = part[:3]
        wrapped[0] |= part[3]
    if wrapped[0]:  # the whole search's codes then rounded with nearest_int's bits, as the numpy path's
        np.add(codes, np.float32(0), out=codes)  # -0 + 0 is +0, every other code itself
    return scale, offset, codes
