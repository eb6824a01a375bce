"""The candidate searches behind :mod:`.kquants`' K-quant encoders, each over many sub-blocks at once, in
llama.cpp's float32 arithmetic and order (``shared/reference/kquants.md`` §2).

Values are laid out element-major, ``(n, S)`` for S sub-blocks of n values, so each elementwise step is one numpy
call over all sub-blocks and each sum (:func:`fsum`) is ``np.add.reduce`` over axis 0, which numpy runs as a
sequential accumulation in index order, as C's loop sums.

The searches (names as in ``ggml-quants.c``, which this module follows but does not copy):

- ``qkx`` (``make_qkx2_quants``/``make_qkx3_quants``): an asymmetric scale and min by least squares over a ladder
  of candidate inverse scales, each candidate's grid anchored at the best min found so far.
- ``qx`` (``make_qx_quants``): a symmetric, signed scale (the largest magnitude takes code 0) over 19 candidates.
- ``q3`` (``make_q3_quants``): ``qx``'s start, then coordinate descent on the codes.
- ``qp`` (``make_qp_quants``): the non-negative sub-block scales themselves quantized (importance path only).

A candidate is adopted on a strict improvement, so the first of equals wins, as in the scalar loop; a coordinate
descent pass that changes nothing leaves its sub-block as it was, so running further passes over converged
sub-blocks (while others still change) changes nothing. Values must be finite (llama.cpp asserts the same).

At float32's ends (magnitudes whose squares or cubes overflow, subnormals whose inverse scales overflow) llama.cpp's
sums become inf or NaN and its ``nearest_int`` sees arguments past its range: :func:`ni` is that function exactly
(the wrapped mantissa; NaN is 0), used wherever an argument can leave the range (checked per column, :func:`tame`),
``np.rint`` where none can; C's int8 and uint8 stores wrap (:func:`as_int8`, :func:`as_uint8`), and its scans skip a
NaN as ``>`` does (:func:`largest`, :func:`positive_max`) or take it as ``MAX`` does (:func:`scan_max`).

Where numba is installed, ``qx_lazy``/``qx``, ``q3`` and ``qp`` run their compiled twins (:mod:`.qxloop`) instead,
and ``qkx`` its (:mod:`.qkxloop`), to the same bits; the numpy code here is the path without it, and the reference
those are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from resumerge.outputs.gguf import qkxloop, qxloop
from resumerge.outputs.gguf.kfloat import EPS, MAGIC, TAME, F

__all__ = ["EPS", "F", "as_int8", "as_uint8", "f16", "fsum", "largest", "ni", "positive_max", "q3", "qkx", "qkx_numpy",
           "qp", "qx", "qx_lazy", "tame"]

_Array = np.ndarray


def ni(v: _Array) -> _Array:
    """llama.cpp's ``nearest_int`` of float32 ``v`` exactly, as float32: the mantissa of ``v + 1.5·2^23`` less
    2^22. Round half to even (``np.rint``) for |v| <= 4194303; beyond, and for inf and NaN, the wrapped value C
    reads (NaN is 0, ±inf is -4194304), which the clamps after it then see. Used where an argument can leave that
    range (tiny scales, overflowing sums: magnitudes near float32's ends); ``np.rint`` elsewhere."""
    bits = np.add(v, MAGIC, dtype=F).view(np.int32)
    bits &= 0x7FFFFF
    bits -= 0x400000
    exact: _Array = bits.astype(F)
    return exact


def tame(bound: _Array) -> bool:
    """Whether every nearest_int argument is within ``bound`` (per column) <= 4e6 (False for inf and NaN: the
    maximum is NaN where one is; the ufunc's own reduce, numpy's ``all`` wrapper cost a tenth of a search)."""
    return bool(np.maximum.reduce(bound, axis=None) <= TAME)


def fsum(a: _Array) -> _Array:
    """The float32 sum over axis 0 in index order, from 0 (``s = 0; s += a[i]``)."""
    if a.ndim == 2 and a.shape[1] == 1:  # numpy sums a lone column pairwise: as two columns, in order
        return fsum(np.repeat(a, 2, axis=1))[:1]
    total: _Array = np.add.reduce(a, axis=0, initial=F(0))
    return total


def fsum_first(a: _Array) -> _Array:
    """The float32 sum over axis 0 in index order, from ``a[0]`` (``s = a[0]; s += a[i]`` for i >= 1)."""
    if a.ndim == 2 and a.shape[1] == 1:  # as fsum
        return fsum_first(np.repeat(a, 2, axis=1))[:1]
    total: _Array = np.add.reduce(a, axis=0)
    return total


def as_uint8(v: _Array) -> _Array:
    """Integer-valued float32 ``v`` stored into a uint8, as C does (modulo 256)."""
    return (v.astype(np.int32) & 0xFF).astype(np.uint8)


def f16(v: _Array) -> tuple[_Array, _Array]:
    """``v`` rounded to float16 (its bits as uint16) and that half back as float32."""
    half = v.astype(np.float16)
    return half.view(np.uint16), half.astype(F)


def largest(x: _Array) -> tuple[_Array, _Array]:
    """Per column: the largest magnitude and the (signed) value of the first element reaching it, from the max and
    min (fast reductions); where both signs reach it, the first, as llama.cpp's strict ``>`` scan takes."""
    hi = x.max(axis=0)
    lo = x.min(axis=0)
    neg = -lo
    amax: _Array = np.maximum(hi, neg)
    peak: _Array = np.where(hi >= neg, hi, lo)
    tied = np.flatnonzero((hi == neg) & (hi > 0))
    if tied.size:
        sub = x[:, tied]
        first = np.argmax(np.abs(sub), axis=0)
        peak[tied] = sub[first, np.arange(tied.size)]
    nan = np.flatnonzero(np.isnan(amax))
    if nan.size:  # the scan never takes a NaN (|NaN| > amax is false); all NaN leaves its 0
        top, at = np.zeros(nan.size, dtype=F), np.zeros(nan.size, dtype=F)
        for row in x[:, nan]:
            take = np.abs(row) > top
            top = np.where(take, np.abs(row), top)
            at = np.where(take, row, at)
        amax[nan], peak[nan] = top, at
    return amax, peak


def scan_max(x: _Array) -> _Array:
    """Per column, ``m = 0; m = m > x_i ? m : x_i`` in index order (C's ``MAX``, which a NaN takes over until
    the next value replaces it)."""
    m = np.zeros(x.shape[1:], dtype=F)
    for row in x:
        m = np.where(m > row, m, row)
    return m


def positive_max(x: _Array) -> _Array:
    """Per column, the largest value above 0, else 0 (``if (s > m) m = s`` from 0: a NaN is never taken)."""
    top: _Array = np.fmax(np.fmax.reduce(x, axis=0), F(0))
    return top


def as_int8(v: _Array) -> _Array:
    """Integer-valued float32 ``v`` stored into an int8 and read back, as C does (modulo 256), as float32."""
    wrapped: _Array = ((v.astype(np.int32) + 128) & 0xFF).astype(F) - F(128)
    return wrapped


def qkx(x: _Array, w: _Array, nmax: int, rmin: float, rdelta: float, nstep: int, *, mad: bool,
        v3: bool) -> tuple[_Array, _Array, _Array]:
    """``make_qkx2_quants`` (``v3`` False) / ``make_qkx3_quants`` (weights given) of each column of ``x`` (n, S):
    (scale, the min as a non-negative offset, codes). Compiled (:mod:`.qkxloop`) where numba is installed, else
    :func:`qkx_numpy`: the same bits."""
    found = qkxloop.qkx(x, w, nmax, rmin, rdelta, nstep, mad=mad, v3=v3, rest=_qkx_numpy)
    return qkx_numpy(x, w, nmax, rmin, rdelta, nstep, mad=mad, v3=v3) if found is None else found


def qkx_numpy(x: _Array, w: _Array, nmax: int, rmin: float, rdelta: float, nstep: int, *, mad: bool,
              v3: bool) -> tuple[_Array, _Array, _Array]:
    """:func:`qkx` in numpy."""
    scale, offset, codes, _ = _qkx_numpy(x, w, nmax, rmin, rdelta, nstep, mad=mad, v3=v3)
    return scale, offset, codes


def _qkx_numpy(x: _Array, w: _Array, nmax: int, rmin: float, rdelta: float, nstep: int, *, mad: bool,
               v3: bool) -> tuple[_Array, _Array, _Array, bool]:
    """:func:`qkx_numpy`, and whether its codes were rounded with nearest_int's bits (some column's argument past
    the range where that is ``np.rint``: every code then, whose zeros are all +0 where ``np.rint`` keeps -0).
    The candidates' temporaries live in three buffers of ``x``'s shape, every step in place (fresh arrays of this
    size were half the time)."""
    lo = x.min(axis=0)
    hi = x.max(axis=0)
    reach = np.maximum(hi, -lo)  # the largest |x| of each column, bounding the grids' arguments
    sum_w = fsum_first(w)
    sum_x = fsum_first(w * x)
    lo = np.where(lo > 0, F(0), lo)
    flat = hi <= lo if v3 else hi == lo
    top = F(nmax)
    v, q, t = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def error(s: _Array, m: _Array) -> _Array:
        """Σ w·|s·q + m − x| (or its square) of the codes in ``q``, through ``t``."""
        np.multiply(s, q, out=t)
        np.add(t, m, out=t)
        np.subtract(t, x, out=t)
        if mad:
            np.abs(t, out=t)
        else:
            np.multiply(t, t, out=t)
        np.multiply(t, w, out=t)
        return fsum(t)

    def grid(iscale: _Array, anchor: _Array, extent: _Array) -> bool:
        """The codes of ``iscale`` on the grid anchored at ``anchor``, into ``q``, clamped to 0..nmax. (Clamping
        before rounding is the same, the bounds being integers, where every argument is within nearest_int's
        range, bounded per column by |iscale| times ``extent``, the largest |x| plus |anchor|; else the exact
        nearest_int first, then the clamp.) Whether that was nearest_int's bits."""
        np.subtract(x, anchor, out=q)
        np.multiply(q, iscale, out=q)
        wrapped = not tame(np.abs(iscale) * extent)
        if wrapped:
            q[...] = ni(q)
        np.clip(q, F(0), top, out=q)
        np.rint(q, out=q)
        return wrapped

    span = np.where(flat, F(1), hi - lo)  # max − min, min being the adopted one
    iscale = top / span
    scale = F(1) / iscale
    extent = reach + np.abs(lo)  # of the grids anchored at lo, kept as lo is adopted
    grid(iscale, lo, extent)
    best = error(scale, lo)
    # the adopted candidate's grid, its codes taken once at the end (the same float32 steps, so the same codes)
    chosen, anchor = iscale, lo.copy()
    # the bookkeeping over (S,) rows in place (fresh arrays, numpy's allocations, were a sixth of the search)
    iscale, det, part, this_scale, this_min = (np.empty_like(lo) for _ in range(5))
    ok, positive, better = (np.empty(lo.shape, dtype=bool) for _ in range(3))
    live = ~flat
    for step in range(nstep + 1):
        np.divide(F(rmin) + F(rdelta) * F(step) + top, span, out=iscale)
        grid(iscale, lo, extent)
        np.multiply(w, q, out=t)
        sum_l = fsum(t)
        np.multiply(t, x, out=v)
        sum_xl = fsum(v)
        t *= q
        sum_l2 = fsum(t)
        np.multiply(sum_w, sum_l2, out=det)
        det -= np.multiply(sum_l, sum_l, out=part)
        np.greater(det, F(0), out=ok)
        np.multiply(sum_w, sum_xl, out=this_scale)
        this_scale -= np.multiply(sum_x, sum_l, out=part)
        this_scale /= det
        np.multiply(sum_l2, sum_x, out=this_min)
        this_min -= np.multiply(sum_l, sum_xl, out=part)
        this_min /= det
        np.greater(this_min, F(0), out=positive)
        if positive.any():
            this_min[positive] = 0
            np.divide(sum_xl, sum_l2, out=this_scale, where=positive)
        current = error(this_scale, this_min)
        np.less(current, best, out=better)
        better &= ok
        better &= live
        if better.any():
            np.copyto(chosen, iscale, where=better)
            np.copyto(anchor, lo, where=better)
            np.copyto(best, current, where=better)
            np.copyto(scale, this_scale, where=better)
            np.copyto(lo, this_min, where=better)
            np.subtract(hi, lo, out=span, where=better)
            np.add(reach, np.abs(lo), out=extent)
    wrapped = grid(chosen, anchor, reach + np.abs(anchor))
    codes = q
    scale = np.where(flat, F(0), scale)
    codes[:, flat] = 0
    return scale, -lo, codes, wrapped


def qx(x: _Array, nmax: int, qw: _Array | None) -> tuple[_Array, _Array]:
    """``make_qx_quants(n, nmax, x, L, 1, qw)`` of each column of ``x`` (n, S): (signed scale, codes 0..2nmax-1)."""
    scale, codes_at = qx_lazy(x, nmax, qw)
    return scale, codes_at(np.arange(x.shape[1]))


def qx_lazy(x: _Array, nmax: int, qw: _Array | None) -> tuple[_Array, Callable[[_Array], _Array]]:
    """:func:`qx`'s scales, and its codes as a function of the columns wanted (the K encoders recompute every
    code from the stored scales, and keep the search's only where a stored scale is 0: a few columns).
    The candidates' codes and products live in two buffers of ``x``'s shape, every step in place; a column keeps
    the inverse scale it adopts, and the codes are taken from those when asked (the same float32 product and
    rounding as the candidate's, so the same codes, without copying every adopted candidate's). Compiled
    (:mod:`.qxloop`) where numba is installed, to the same bits."""
    compiled = qxloop.kernels()
    if compiled is not None:
        found, chosen, zero, in_range = compiled.qx(x, x if qw is None else qw, nmax, qw is None)
        return found, _qx_codes(x, nmax, chosen, zero, in_range)
    amax, peak = largest(x)
    zero = ~(amax >= EPS)
    peak = np.where(zero, F(1), peak)
    w = x * x if qw is None else qw
    wx = w * x
    low, high = F(-nmax), F(nmax - 1)
    q, t = np.empty_like(x), np.empty_like(x)

    # every candidate's |iscale| is at most (nmax + 0.9)/|peak|, so one bound (nmax + 1 over the largest
    # magnitude, which is |peak|) covers them all: finite unless peak is subnormal enough to overflow it
    in_range = tame(F(nmax + 1) / np.abs(peak) * amax)

    def codes_of(iscale: _Array) -> None:
        """The codes of ``iscale`` (unshifted) into ``q``."""
        np.multiply(iscale, x, out=q)
        if in_range:
            np.rint(q, out=q)
        else:
            q[...] = ni(q)
        np.clip(q, low, high, out=q)

    def sums(iscale: _Array) -> tuple[_Array, _Array]:
        """The codes of ``iscale`` into ``q``: their Σwxq and Σwq²."""
        codes_of(iscale)
        np.multiply(wx, q, out=t)
        sumlx = fsum(t)
        np.multiply(w, q, out=t)
        np.multiply(t, q, out=t)
        return sumlx, fsum(t)

    chosen = F(-nmax) / peak
    sumlx, suml2 = sums(chosen)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 == 0, F(1), suml2), F(0))
    best = scale * sumlx
    # the bookkeeping over (S,) rows in place (fresh arrays, numpy's allocations, were a fifth of the search)
    iscale, fit, bar = (np.empty_like(peak) for _ in range(3))
    adopt, positive = (np.empty(peak.shape, dtype=bool) for _ in range(2))
    for step in range(-9, 10):
        if step == 0:
            continue
        np.divide(-(F(nmax) + F(0.1) * F(step)), peak, out=iscale)
        sumlx, suml2 = sums(iscale)
        np.multiply(sumlx, sumlx, out=fit)
        np.multiply(best, suml2, out=bar)
        np.greater(fit, bar, out=adopt)
        np.greater(suml2, F(0), out=positive)
        adopt &= positive
        if adopt.any():
            np.copyto(chosen, iscale, where=adopt)
            np.divide(sumlx, suml2, out=scale, where=adopt)
            np.multiply(scale, sumlx, out=best, where=adopt)
    return np.where(zero, F(0), scale), _qx_codes(x, nmax, chosen, zero, in_range)


def _qx_codes(x: _Array, nmax: int, chosen: _Array, zero: _Array, in_range: bool) -> Callable[[_Array], _Array]:
    """:func:`qx_lazy`'s codes of ``x`` (n, S) as a function of the columns wanted, from the adopted inverse
    scales ``chosen``, the all-zero columns ``zero`` and whether the search rounded with ``np.rint``."""

    def codes_at(cols: _Array) -> _Array:
        """The adopted candidates' codes of columns ``cols``, shifted to 0..2nmax-1 (0 in an all-zero column)."""
        some: _Array = x[:, cols] * chosen[cols]
        some = np.rint(some, out=some) if in_range else ni(some)
        np.clip(some, F(-nmax), F(nmax - 1), out=some)
        some += F(nmax)
        some[:, zero[cols]] = 0
        return some

    return codes_at


def q3(x: _Array, nmax: int) -> tuple[_Array, Callable[[_Array], _Array]]:
    """``make_q3_quants(n, nmax, x, L, true)`` of each column of ``x`` (n, S): (scale, its codes 0..2nmax-1 as a
    function of the columns wanted, as :func:`qx_lazy`'s). Compiled (:mod:`.qxloop`) where numba is installed, to
    the same bits."""
    low, high = F(-nmax), F(nmax - 1)
    compiled = qxloop.kernels()
    if compiled is not None:
        zero, q = compiled.q3_start(x, nmax)
        sumlx, suml2 = compiled.descend(x, x, q, float(low), float(high), False, True)
    else:
        amax, peak = largest(x)
        zero = ~(amax >= EPS)
        peak = np.where(zero, F(1), peak)
        iscale = F(-nmax) / peak
        q = iscale * x
        q = np.rint(q, out=q) if tame(np.abs(iscale) * amax) else ni(q)
        np.clip(q, low, high, out=q)
        w = x * x
        wx = w * x
        terms = (wx * q, w * q * q)
        sumlx, suml2 = descend(x, w, wx, q, fsum(terms[0]), fsum(terms[1]), low, high, need_sl2=False, terms=terms)

    def codes_at(cols: _Array) -> _Array:
        """The codes of columns ``cols``, shifted to 0..2nmax-1 (0 in an all-zero column)."""
        some: _Array = q[:, cols] + F(nmax)
        some[:, zero[cols]] = 0
        return some

    return _fit_scale(sumlx, suml2, zero), codes_at


def descend(x: _Array, w: _Array, wx: _Array, q: _Array, sumlx: _Array, suml2: _Array, low: float, high: float,
            *, need_sl2: bool, terms: tuple[_Array, _Array] | None = None) -> tuple[_Array, _Array]:
    """Up to five passes of llama.cpp's coordinate descent on codes ``q`` (n, S) (in place): each code in turn
    moved to its least-squares value given the others, kept when the weighted fit improves. ``need_sl2``: also
    require the reduced sum of squares to be positive before trying (``make_qp_quants``), else after
    (``make_q3_quants``). Returns the final (Σwxq, Σwq²). ``terms``: the products ``wx·q`` and ``w·q·q`` the
    starting sums were taken of, where the caller has them (the first round's, not taken again).

    Taken move by move rather than step by step: a column's sums change only where a move is kept, so from its
    cursor (the step after its last kept move) every step up to its next kept move sees the same sums and codes,
    and is what trying every position at once against them (:func:`_trial`) gives; a step's arithmetic there is
    the scalar loop's. Each round takes every live column's next kept move, the first in the loop's order from
    its cursor, past the end of a pass into the next. A column with none in a whole cycle is converged (the loop
    stops after a pass with no change, and a pass repeating these sums and codes changes nothing), and one whose
    next move would fall in a sixth pass is done. A round is ~30 numpy calls over the live columns where a
    pass step by step is ~30 a position, and most columns move once or never (measured: 1 in 5 moves at all)."""
    n, width = x.shape
    sumlx, suml2 = sumlx.copy(), suml2.copy()
    cols: _Array | None = None  # the live columns (None: all)
    cursor = np.zeros(width, dtype=np.int8)  # each live column's next step
    passes = np.zeros(width, dtype=np.int8)  # each live column's pass at its cursor, 0..4
    order = np.arange(n, dtype=np.int8)[:, None]
    # every round's (n, live) arrays are views of these (fresh arrays this size were most of a round: the
    # allocator hands large ones back to the system, and each new one is paged in again); the live columns'
    # values are gathered from the round before's (from the whole arrays, every round would read all of them)
    size = n * width
    floats = np.empty((13, size), dtype=F)
    flags = np.empty((3, size), dtype=bool)
    ahead = np.empty(size, dtype=np.int8)
    xs, ws, wxs, qs, lx, l2 = x, w, wx, q, sumlx, suml2
    spare = 5
    while True:
        live = xs.shape[1]
        f = floats[:5, :n * live].reshape(5, n, live)
        b = flags[:, :n * live].reshape(3, n, live)
        keep, new, slx, sl2 = _trial(xs, ws, wxs, qs, lx, l2, (low, high), (f, b), need_sl2=need_sl2, terms=terms)
        terms = None
        # each step's place in the loop's order from the cursor (0 at the cursor), n + that where not kept
        rank = ahead[:n * live].reshape(n, live)
        np.subtract(order, cursor, out=rank)
        if n & (n - 1) == 0:  # modulo n, then n on
            rank &= np.int8(n - 1)
            rank += np.int8(n)
        else:
            rank += np.where(rank < 0, np.int8(2 * n), np.int8(n))
        rank -= keep.view(np.int8) * np.int8(n)
        step = np.minimum.reduce(rank, axis=0)
        at = cursor + step  # the next kept move's step, counted on from the cursor's pass
        wraps = at >= n
        passes += wraps
        moving = np.flatnonzero((step < n) & (passes < 5))
        if moving.size == 0:
            break
        at = at[moving] - np.where(wraps[moving], np.int8(n), np.int8(0))
        flat = at.astype(np.intp) * live + moving
        moved, lx, l2 = new.reshape(-1)[flat], slx.reshape(-1)[flat], sl2.reshape(-1)[flat]
        where = moving if cols is None else cols[moving]
        q[at, where] = moved
        sumlx[where] = lx
        suml2[where] = l2
        if cols is not None:
            qs[at, moving] = moved
        last = at == n - 1
        cursor = np.where(last, np.int8(0), at + np.int8(1)).astype(np.int8)
        passes = passes[moving] + last
        # a move in the fifth pass's last step ends the loop
        going = np.flatnonzero(passes < 5)
        if going.size == 0:
            break
        cols, cursor, passes, lx, l2 = where[going], cursor[going], passes[going], lx[going], l2[going]
        taken = moving[going]
        g = floats[spare:spare + 4, :n * taken.size].reshape(4, n, taken.size)
        for a, out in zip((xs, ws, wxs, qs), g, strict=True):
            np.take(a, taken, axis=1, out=out)
        xs, ws, wxs, qs = g
        spare = 14 - spare  # the other four
    return sumlx, suml2


def _trial(xs: _Array, ws: _Array, wxs: _Array, qs: _Array, lx: _Array, l2: _Array, bounds: tuple[float, float],
           scratch: tuple[_Array, _Array], *, need_sl2: bool, terms: tuple[_Array, _Array] | None = None
           ) -> tuple[_Array, _Array, _Array, _Array]:
    """Every step of the descent tried at once over (n, S) against the sums ``lx``, ``l2`` (S,) and codes ``qs``
    as they stand: (whether each move is kept, the new codes, the sums after each move), the codes held within
    ``bounds`` (low, high), in ``scratch``: ``f`` (5, n, S) float32 and ``b`` (3, n, S) bool. The scalar loop's
    float32 operations, in its order. ``terms``: each position's ``wx·q`` and ``w·q·q`` of these codes, where the
    caller has them."""
    low, high = bounds
    f, b = scratch
    slx, sl2, new, t, fit = f
    keep, tried, flag = b
    if terms is None:
        np.multiply(wxs, qs, out=slx)
        np.multiply(ws, qs, out=sl2)
        sl2 *= qs
        terms = (slx, sl2)
    np.subtract(lx, terms[0], out=slx)
    np.subtract(l2, terms[1], out=sl2)
    np.greater(slx, F(0), out=tried)
    if need_sl2:
        tried &= np.greater(sl2, F(0), out=flag)
    np.multiply(xs, sl2, out=new)
    new /= slx
    # nearest_int exactly (slx can be tiny: no bound on the argument), in place: see ni
    new += MAGIC
    bits = new.view(np.int32)
    bits &= 0x7FFFFF
    bits -= 0x400000
    np.copyto(new, bits, casting="unsafe")
    np.clip(new, low, high, out=new)
    np.not_equal(new, qs, out=keep)
    keep &= tried
    np.multiply(wxs, new, out=t)
    slx += t
    np.multiply(ws, new, out=t)
    t *= new
    sl2 += t
    u = np.multiply(lx, lx)
    np.multiply(u, sl2, out=fit)
    np.multiply(slx, slx, out=t)
    t *= l2
    np.greater(t, fit, out=flag)
    keep &= flag
    if not need_sl2:
        keep &= np.greater(sl2, F(0), out=flag)
    return keep, new, slx, sl2


def qp(x: _Array, nmax: int, w: _Array) -> tuple[_Array, _Array]:
    """``make_qp_quants(n, nmax, x, L, w)`` of each column of ``x`` (n, S; values >= 0 in practice): (scale, codes
    as the uint8 llama.cpp stores them, as float32). Compiled (:mod:`.qxloop`) where numba is installed, to the
    same bits."""
    compiled = qxloop.kernels()
    if compiled is not None:
        zero, q = compiled.qp_start(x, w, nmax)
        sumlx, suml2 = compiled.descend(x, w, q, -np.inf, float(nmax), True, False)
        return _fit_scale(sumlx, suml2, zero), np.where(zero, F(0), q)
    peak = scan_max(x)
    zero = peak < EPS
    peak = np.where(zero, F(1), peak)
    top = F(nmax)
    iscale = top / peak
    q = ni(iscale * x)
    q = np.where(q < 0, q + F(256), q)  # stored in a uint8 before its error is taken
    scale = F(1) / iscale
    diff = x - scale * q
    best = fsum(w * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F(0.1) * F(step) + top) / peak
        scale_is = F(1) / iscale_is
        q = np.minimum(top, ni(iscale_is * x))
        diff = x - scale_is * q
        mse = fsum(w * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_is, iscale)
    q = np.minimum(top, ni(iscale * x))
    q = np.where(q < 0, q + F(256), q)  # stored in a uint8
    wx = w * x
    terms = (wx * q, w * q * q)
    sumlx, suml2 = descend(x, w, wx, q, fsum(terms[0]), fsum(terms[1]), -np.inf, float(nmax), need_sl2=True,
                           terms=terms)
    return _fit_scale(sumlx, suml2, zero), np.where(zero, F(0), q)


def _fit_scale(sumlx: _Array, suml2: _Array, zero: _Array) -> _Array:
    """:func:`q3`'s and :func:`qp`'s scales from the descent's final sums: Σwxq/Σwq² where that is positive, else
    (and in an all-zero column) 0."""
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F(1)), F(0))
    found: _Array = np.where(zero, F(0), scale)
    return found
