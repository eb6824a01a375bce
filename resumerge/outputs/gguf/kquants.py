"""GGUF's K-quant tensors (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) encoded to the bytes llama.cpp's quantizer writes
(``ggml_quantize_chunk``), with or without an importance matrix (``shared/reference/kquants.md`` §1-2).

Each K type codes 256 values a super-block: 16 or 8 sub-blocks, each with its own small integer scale (and min),
found by a search over candidate scales, then the super-block's float16 scale(s) and the codes recomputed from the
stored scales. llama.cpp runs that search in scalar float32, left to right; a different summation order changes a
byte now and then (a float64 port changed 2 of 1,728 Q4_K bytes). So this module keeps every operation float32
and in llama.cpp's order, and vectorises *across* sub-blocks instead: values are laid out element-major, ``(n,
S)`` for S sub-blocks of n values, so each elementwise step is one numpy call over all sub-blocks and each sum is
``np.add.reduce`` over axis 0, which numpy runs as a sequential accumulation in index order (a reduction over the
contiguous axis would be pairwise). ``nearest_int`` (adding 1.5·2^23 and reading the mantissa) is round half to
even, ``np.rint`` on a float32; float16 conversion is numpy's round to nearest even, as ggml's software one.
The candidate searches themselves are :mod:`.ksearch`'s. The layouts in and out (a chunk of super-blocks as
sub-blocks with their weights; the codes recomputed from the stored scales, packed into the output's bytes) are
:mod:`.klayout`'s compiled kernels where numba is, and this module's numpy steps otherwise, to the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from resumerge.inputs.gguf.ggmltypes import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, TYPES
from resumerge.outputs.gguf import klayout
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.klayout import ABS, IMPORTANCE, PLAIN, QW, RMS
from resumerge.outputs.gguf.ksearch import F

__all__ = ["K_TYPES", "encode_k"]

QK = 256  # values a super-block
# super-blocks coded together: the (n, S) working arrays stay in the cache (measured: bench/bench_kquants.py);
# Q3_K without importance takes more at once, its coordinate descent being many small steps over (S,) rows whose
# numpy call overhead a wider row spreads thinner (0.19 -> 0.12 s a Mweight measured, 256 -> 1024); 512 for the
# symmetric searches (Q3_K with importance, Q6_K) measured no faster, alternating 9 times. Re-measured with the
# symmetric searches and the glue compiled (session 47, 2048x5632, best of 4 alternated, CPU s): Q3_K plain 256 /
# 1024 / 4096: 0.069 / 0.063 / 0.107; Q3_K with importance 256 / 1024: 0.075 / 0.087; Q6_K 256 / 1024: 0.052 /
# 0.056
_CHUNK = 256
_CHUNK_Q3 = 1024
# the importance paths: their sub-block scales' own searches (make_qp_quants: 8 or 16 values, a descent) are
# many tiny numpy steps, so those run over this many super-blocks at once, the values' searches over _CHUNK at a
# time inside them
_CHUNK_QP = 2048

_Array = np.ndarray


def _subblocks(xt: _Array, n: int) -> _Array:
    """Super-blocks ``xt`` (256, B) as sub-blocks of ``n`` values, element-major: (n, 256/n * B), sub-block j of
    super-block b in column ``j*B + b``."""
    b = xt.shape[1]
    return np.ascontiguousarray(xt.reshape(QK // n, n, b).transpose(1, 0, 2)).reshape(n, -1)


def _superblocks(codes: _Array, n: int, b: int) -> _Array:
    """:func:`_subblocks`' codes (n, 256/n * B) back to rows of super-blocks: (B, 256) uint8."""
    rows: _Array = codes.astype(np.uint8, copy=False).reshape(n, QK // n, b).transpose(2, 1, 0).reshape(b, QK)
    return rows


def _sigma2(xt: _Array, factor: float) -> _Array:
    """``factor * Σx² / 256`` of each super-block (columns of ``xt``), the sum in index order."""
    total = ks.fsum(xt * xt)
    mean: _Array = (F(factor) * total if factor != 1 else total) / F(QK)
    return mean


def _importance(xt: _Array, qw: _Array, n: int, factor: float) -> _Array:
    """The importance path's weights ``qw * sqrt(sigma2 + x²)`` as sub-blocks (n, S)."""
    sigma2 = _sigma2(xt, factor)
    return _subblocks(qw * np.sqrt(sigma2 + xt * xt), n)


def _layout(block: _Array, qw: _Array | None, offset: int, n: int, mode: int,
            factor: float = 1.0) -> tuple[_Array, _Array | None, _Array | None]:
    """Super-blocks ``block`` (B, 256) as sub-blocks of ``n`` values (:func:`_subblocks`) with their weights as
    ``mode`` says (:mod:`.klayout`), super-block b weighted by row ``(offset + b) % len(qw)`` of ``qw``: (x, the
    weights or None, each sub-block's Σ weights for IMPORTANCE or None). Compiled in one pass where numba is."""
    b = block.shape[0]
    kernels = klayout.kernels()
    if kernels is not None:
        x = np.empty((n, QK // n * b), dtype=F)
        w = np.empty_like(x) if mode != PLAIN else np.empty((0, 0), dtype=F)
        sw = np.empty(x.shape[1], dtype=F) if mode == IMPORTANCE else np.empty(0, dtype=F)
        rows = qw if qw is not None else np.empty((1, QK), dtype=F)
        kernels.lay_out(block, rows, offset, n, mode, factor, x, w, sw)
        return x, (None if mode == PLAIN else w), (sw if mode == IMPORTANCE else None)
    xt = np.ascontiguousarray(block.T)
    x = _subblocks(xt, n)
    if mode == ABS:
        return x, np.abs(x), None
    if mode == RMS:  # make_qkx2_quants' weights of Q4_K / Q5_K
        return x, np.sqrt(ks.fsum(x * x) / F(n)) + np.abs(x), None
    if mode == PLAIN or qw is None:
        return x, None, None
    weights = np.ascontiguousarray(qw[(offset + np.arange(b)) % qw.shape[0]].T)
    if mode == QW:
        return x, _subblocks(weights, n), None
    w = _importance(xt, weights, n, factor)
    return x, w, ks.fsum(w)


def _codes(x: _Array, codes: _Array | Callable[[_Array], _Array], d: _Array, m: _Array | None, low: int,
           high: int) -> _Array:
    """The codes recomputed from the stored scales (:func:`_recode` with offsets ``m``; :func:`_recode_lazy`
    with the search's codes as a function), shifted by ``-low``, as uint8 in ``x``'s layout. Compiled in one
    pass where numba is and the ratios are within nearest_int's round half to even range."""
    kernels = klayout.kernels()
    if kernels is not None:
        out = np.empty(x.shape, dtype=np.uint8)
        if kernels.recode(x, d, m if m is not None else np.zeros_like(d), low, high, -low, out):
            dead = np.flatnonzero(~(d != 0))  # NaN is live, as C's ``if (!d)``
            if dead.size:
                out[:, dead] = codes(dead) if callable(codes) else codes[:, dead]
            return out
    if callable(codes):
        return _recode_lazy(x, codes, d, low, high)
    return _recode(x, codes, d, m, low, high).astype(np.uint8)


def _pack(codes: _Array, kind: int, out: _Array) -> None:
    """Codes (n, 256/n * B) uint8 (shifted to 0 and up) packed as K type ``kind``'s quants into their bytes of
    ``out`` (B, block bytes); the heads' bytes are the caller's. Compiled where numba is."""
    kernels = klayout.kernels()
    if kernels is not None:
        kernels.pack(codes, kind, out)
        return
    b = out.shape[0]
    q = _superblocks(codes, codes.shape[0], b)
    if kind == Q2_K:
        out[:, 16:80] = _planes(q)
    elif kind == Q3_K:  # element e's high bit is bit e//32 of hmask[e%32], its low two bits as Q2_K's
        high = (q >> 2).reshape(b, 8, 32)
        hmask = high[:, 0].copy()
        for m in range(1, 8):
            hmask |= high[:, m] << m
        out[:, 0:32] = hmask
        out[:, 32:96] = _planes(q & 3)
    elif kind == Q4_K:
        c = q.reshape(b, 4, 2, 32)
        out[:, 16:144] = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(b, 128)
    elif kind == Q5_K:
        c = q.reshape(b, 4, 2, 32)
        high = (c >> 4) << np.array([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=np.uint8)[None, :, :, None]
        out[:, 16:48] = np.bitwise_or.reduce(high.reshape(b, 8, 32), axis=1)
        out[:, 48:176] = ((c[:, :, 0] & 0xF) | ((c[:, :, 1] & 0xF) << 4)).reshape(b, 128)
    else:
        c = q.reshape(b, 2, 4, 32)
        low = c & 0xF
        ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
        out[:, 0:128] = ql.reshape(b, 128)
        hi = c >> 4
        out[:, 128:192] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(b, 64)


def _recode(x: _Array, codes: _Array, d: _Array, m: _Array | None, low: float, high: float) -> _Array:
    """Codes recomputed from the stored scale ``d`` (and offset ``m``) of each sub-block (columns of ``x``);
    where ``d`` is 0 the search's codes stay."""
    live = d != 0  # NaN too, as C's ``if (!d)``
    safe = np.where(live, d, F(1))
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = ((x + m) if m is not None else x) / safe
        reach = np.maximum(x.max(axis=0), -x.min(axis=0)) + (0 if m is None else np.abs(m))
        fresh = np.clip(np.rint(ratio) if ks.tame(reach / np.abs(safe)) else ks.ni(ratio), low, high)
    return np.where(live, fresh, codes)


def _recode_lazy(x: _Array, codes_at: Callable[[_Array], _Array], d: _Array, low: int, high: int) -> _Array:
    """:func:`_recode` of a symmetric type, its codes shifted by ``-low``, as uint8, with the search's codes asked
    of ``codes_at`` (shifted already) only for the columns whose stored scale is 0. Each step in place on one
    array (the where of :func:`_recode` over every column, and fresh arrays, were a third of this)."""
    live = d != 0  # NaN too, as C's ``if (!d)``
    safe = np.where(live, d, F(1))
    with np.errstate(invalid="ignore", over="ignore"):
        reach = np.maximum(x.max(axis=0), -x.min(axis=0))
        ratio = np.divide(x, safe)
        if ks.tame(reach / np.abs(safe)):
            np.rint(ratio, out=ratio)
        else:
            ratio = ks.ni(ratio)
    np.clip(ratio, F(low), F(high), out=ratio)
    codes = np.empty(x.shape, dtype=np.uint8)
    np.subtract(ratio, F(low), out=codes, casting="unsafe")
    dead = np.flatnonzero(~live)
    if dead.size:
        codes[:, dead] = codes_at(dead)
    return codes


def _planes(codes: _Array) -> _Array:
    """2-bit codes (B, 256) as Q2_K/Q3_K's ``qs`` (B, 64): byte ``32h + l`` holds element ``128h + 32k + l`` at
    bits 2k."""
    c = codes.reshape(-1, 2, 4, 32)
    packed: _Array = (c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).reshape(-1, 64)
    return packed


def _pack_k4_scales(ls: _Array, lm: _Array) -> _Array:
    """Eight 6-bit scales and mins (uint8, (8, B)) as Q4_K/Q5_K's 12 bytes (B, 12) (``get_scale_min_k4``)."""
    out = np.zeros((ls.shape[1], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:4].T
    out[:, 4:8] = lm[:4].T
    out[:, 8:12] = (ls[4:].T & 0xF) | ((lm[4:].T & 0xF) << 4)
    out[:, 0:4] |= ((ls[4:].T >> 4) << 6).astype(np.uint8)
    out[:, 4:8] |= ((lm[4:].T >> 4) << 6).astype(np.uint8)
    return out


def _unpack_k4_scales(packed: _Array) -> tuple[_Array, _Array]:
    """:func:`_pack_k4_scales`' inverse as llama.cpp reads it back: (sc, m) float32 (8, B)."""
    p = packed.T.astype(np.int32)
    sc = np.concatenate([p[0:4] & 63, (p[8:12] & 0xF) | ((p[0:4] >> 6) << 4)])
    m = np.concatenate([p[4:8] & 63, (p[8:12] >> 4) | ((p[4:8] >> 6) << 4)])
    return sc.astype(F), m.astype(F)


def _pack_q3_scales(l6: _Array) -> _Array:
    """Sixteen 6-bit values (uint8, (16, B)) as Q3_K's 12 scale bytes (B, 12): the low nibbles of values j and
    j + 8 in byte j, the high two bits of value ``4k + r`` at bits 2k of byte 8 + r (all at once: a step per
    value was most of Q3_K's cost outside its searches)."""
    l6 = l6.astype(np.uint8)
    out = np.empty((l6.shape[1], 12), dtype=np.uint8)
    out[:, 0:8] = ((l6[:8] & 0xF) | ((l6[8:] & 0xF) << 4)).T
    high = (l6 >> 4).reshape(4, 4, -1) << np.arange(0, 8, 2, dtype=np.uint8)[:, None, None]  # [k, r]
    out[:, 8:12] = np.bitwise_or.reduce(high, axis=0).T
    return out


def _unpack_q3_scales(packed: _Array) -> _Array:
    """Q3_K's 12 scale bytes (B, 12) back to the signed scales (16, B) float32 (stored − 32)."""
    p = packed.T.astype(np.int32)
    low = np.concatenate([p[0:8] & 0xF, p[0:8] >> 4])
    high = ((p[None, 8:12] >> np.arange(0, 8, 2, dtype=np.int32)[:, None, None]) & 3).reshape(16, -1)  # [k, r]
    signed: _Array = ((low | (high << 4)) - 32).astype(F)
    return signed


# one search's share of a chunk: its first and end super-block, values (n, S) and codes
_Part = tuple[int, int, _Array, _Array]


def _searched(block: _Array, qw: _Array | None, offset: int, n: int, mode: int, factor: float,
              search: Callable[[_Array, _Array], tuple[_Array, _Array, _Array]]
              ) -> tuple[list[_Part], _Array, _Array, _Array | None]:
    """``search`` (an asymmetric one: :func:`.ksearch.qkx`) of ``_CHUNK`` super-blocks at a time (its working
    arrays stay in the cache while a larger chunk's sub-block scales are searched at once), each share laid out on
    its own (:func:`_layout`: no copy of a share's columns out of the chunk's): the shares, and the chunk's scales,
    mins and (IMPORTANCE) Σ weights as (256/n, B)."""
    groups = QK // n
    rows = 1 if qw is None else qw.shape[0]
    parts: list[_Part] = []
    scales, mins, sums = [], [], []
    for lo in range(0, block.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, block.shape[0])
        x, w, sw = _layout(block[lo:hi], qw, (offset + lo) % rows, n, mode, factor)
        assert w is not None
        scale, low, codes = search(x, w)
        parts.append((lo, hi, x, codes))
        scales.append(scale.reshape(groups, -1))
        mins.append(low.reshape(groups, -1))
        if sw is not None:
            sums.append(sw.reshape(groups, -1))

    def joined(shares: list[_Array]) -> _Array:
        return shares[0] if len(shares) == 1 else np.concatenate(shares, axis=1)

    return parts, joined(scales), joined(mins), joined(sums) if sums else None


def _recoded(parts: list[_Part], sub_d: _Array, sub_m: _Array, high: int, kind: int, out: _Array) -> None:
    """Each share's codes recomputed from its sub-blocks' stored scales and offsets (``sub_d``, ``sub_m``: (256/n,
    B)) and packed as ``kind``'s quants into its rows of ``out``."""
    for lo, hi, x, codes in parts:
        _pack(_codes(x, codes, sub_d[:, lo:hi].reshape(-1), sub_m[:, lo:hi].reshape(-1), 0, high), kind,
              out[lo:hi])


def _qp_pair(scales: _Array, mins: _Array, nmax: int, sw: _Array) -> tuple[_Array, _Array, _Array, _Array]:
    """:func:`.ksearch.qp` of the sub-block scales and of the mins (each (m, B)) in one call (the search is many
    small steps): (d, scale codes, dmin, min codes)."""
    b = scales.shape[1]
    d, codes = ks.qp(np.concatenate([scales, mins], axis=1), nmax, np.concatenate([sw, sw], axis=1))
    return d[:b], codes[:, :b], d[b:], codes[:, b:]


def _q2_k(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    b = block.shape[0]
    if qw is None:
        parts, scales, mins, _ = _searched(block, qw, offset, 16, ABS, 1.0, lambda x, w: ks.qkx(
            x, w, 3, -0.5, 0.1, 15, mad=True, v3=False))
        max_scale = ks.positive_max(scales)
        max_min = ks.positive_max(mins)
        has_scale, has_min = max_scale > 0, max_min > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where(has_scale, ks.ni((F(15) / max_scale) * scales), F(0))
            lm = np.where(has_min, ks.ni((F(15) / max_min) * mins), F(0))
        byte = (ls.astype(np.int32) | (lm.astype(np.int32) << 4)) & 0xFF
        d_bits, d = ks.f16(np.where(has_scale, max_scale / F(15), F(0)))
        m_bits, dmin = ks.f16(np.where(has_min, max_min / F(15), F(0)))
    else:
        parts, scales, mins, sw = _searched(block, qw, offset, 16, IMPORTANCE, 1.0, lambda x, w: ks.qkx(
            x, w, 3, -0.9, 0.05, 36, mad=False, v3=True))
        assert sw is not None
        dm, ls, mm, lm = _qp_pair(scales, mins, 15, sw)
        byte = (ls.astype(np.int32) | (lm.astype(np.int32) << 4)) & 0xFF
        d_bits, d = ks.f16(dm)
        m_bits, dmin = ks.f16(mm)
    out[:, 0:16] = byte.T
    _recoded(parts, d * (byte & 0xF).astype(F), dmin * (byte >> 4).astype(F), 3, Q2_K, out)
    out[:, 80:82] = d_bits.view(np.uint8).reshape(b, 2)
    out[:, 82:84] = m_bits.view(np.uint8).reshape(b, 2)


def _q3_k(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    b = block.shape[0]
    x, w, sw = _layout(block, qw, offset, 16, PLAIN if qw is None else IMPORTANCE, 2.0)
    if w is None or sw is None:
        scales, codes_at = ks.q3(x, 4)
        s = scales.reshape(16, b)
        _, max_scale = ks.largest(s)
        live = max_scale != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(live, F(-32) / np.where(live, max_scale, F(1)), F(0))
            l6 = np.clip(ks.as_int8(ks.ni(iscale * s)), -32, 31) + F(32)
            d_bits, d = ks.f16(np.where(live, F(1) / np.where(live, iscale, F(1)), F(0)))
        packed = np.where(live[:, None], _pack_q3_scales(l6), np.uint8(0))
    else:
        scales, codes_at = ks.qx_lazy(x, 4, w)
        d_block, l6 = ks.qx(scales.reshape(16, b), 32, sw.reshape(16, b))
        packed = _pack_q3_scales(l6)
        d_bits, d = ks.f16(d_block)
    sub_d = (d * _unpack_q3_scales(packed)).reshape(-1)
    _pack(_codes(x, codes_at, sub_d, None, -4, 3), Q3_K, out)
    out[:, 96:108] = packed
    out[:, 108:110] = d_bits.view(np.uint8).reshape(b, 2)


def _k4_scales_ref(scales: _Array, mins: _Array, b: int) -> tuple[_Array, _Array, _Array, _Array]:
    """The no-importance path's 6-bit scales and mins and super-block scales: (packed, d bits, dmin bits, and
    d/dmin as floats stacked)."""
    scales, mins = scales.reshape(8, b), mins.reshape(8, b)
    max_scale = ks.positive_max(scales)
    max_min = ks.positive_max(mins)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))
        inv_min = np.where(max_min > 0, F(63) / max_min, F(0))
    ls = np.minimum(ks.as_uint8(ks.ni(inv_scale * scales)), np.uint8(63))
    lm = np.minimum(ks.as_uint8(ks.ni(inv_min * mins)), np.uint8(63))
    d_bits, d = ks.f16(max_scale / F(63))
    m_bits, dmin = ks.f16(max_min / F(63))
    return _pack_k4_scales(ls, lm), d_bits, m_bits, np.stack([d, dmin])


def _k45(block: _Array, qw: _Array | None, offset: int, nmax: int, out: _Array) -> None:
    """Q4_K (``nmax`` 15) / Q5_K (31) super-blocks into ``out`` (B, block bytes): the head they share (d and
    dmin as float16, then the 12 bytes of 6-bit scales and mins), then the quants."""
    b = block.shape[0]
    if qw is None:
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        parts, scales, mins, _ = _searched(block, qw, offset, 32, RMS, 1.0, lambda x, w: ks.qkx(
            x, w, nmax, rmin, 0.1, nstep, mad=False, v3=False))
        packed, d_bits, m_bits, dd = _k4_scales_ref(scales, mins, b)
        d, dmin = dd[0], dd[1]
    else:
        parts, scales, mins, sw = _searched(block, qw, offset, 32, IMPORTANCE, 2.0, lambda x, w: ks.qkx(
            x, w, nmax, -0.9, 0.05, 36, mad=False, v3=True))
        assert sw is not None
        d_block, ls, m_block, lm = _qp_pair(scales, mins, 63, sw)
        ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
        if nmax == 31:
            ls, lm = np.minimum(ls, np.uint8(63)), np.minimum(lm, np.uint8(63))
        packed = _pack_k4_scales(ls, lm)
        d_bits, d = ks.f16(d_block)
        m_bits, dmin = ks.f16(m_block)
    out[:, 0:2] = d_bits.view(np.uint8).reshape(b, 2)
    out[:, 2:4] = m_bits.view(np.uint8).reshape(b, 2)
    out[:, 4:16] = packed
    sc, m = _unpack_k4_scales(packed)
    _recoded(parts, d * sc, dmin * m, nmax, Q4_K if nmax == 15 else Q5_K, out)


def _q4_k(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    _k45(block, qw, offset, 15, out)


def _q5_k(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    _k45(block, qw, offset, 31, out)


def _q6_k(block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    b = block.shape[0]
    x, w, _ = _layout(block, qw, offset, 16, PLAIN if qw is None else QW)
    scales, codes_at = ks.qx_lazy(x, 32, w)
    s = scales.reshape(16, b)
    amax, max_scale = ks.largest(s)
    live = amax >= ks.EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F(-128) / np.where(live, max_scale, F(1))
        d_bits, d = ks.f16(np.where(live, F(1) / iscale, F(0)))
        sc = ks.as_int8(np.minimum(F(127), ks.ni(iscale * s)))
    sc = np.where(live, sc, F(0))
    _pack(_codes(x, codes_at, (d * sc).reshape(-1), None, -32, 31), Q6_K, out)
    out[:, 192:208] = sc.T.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d_bits.view(np.uint8).reshape(b, 2)
    dead = np.flatnonzero(~live)
    if dead.size:  # a super-block of zeros (or tinier): all its bytes 0
        out[dead] = 0


# ggml type -> its encoder of super-blocks (its row, the block's bytes: resumerge.inputs.gguf.ggmltypes)
_ENCODERS: Mapping[int, Callable[[_Array, _Array | None, int, _Array], None]] = MappingProxyType({
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k})
# the types encode_k encodes
K_TYPES = tuple(_ENCODERS)


def encode_k(rows: _Array, ggml_type: int, importance: _Array | None = None, out: _Array | None = None) -> _Array:
    """llama.cpp's bytes of ``rows`` (float32, (..., n) with n whole super-blocks) as K type ``ggml_type``: uint8
    (..., n / 256 * block bytes), into ``out`` when given (uint8, contiguous, of that many bytes). ``importance``
    (float32, (n,)): llama.cpp's per-column importance for this tensor (an imatrix entry divided by its count), or
    None for the quantizer's path without one."""
    size = TYPES[ggml_type].size
    n = rows.shape[-1]
    values = np.ascontiguousarray(rows, dtype=F).reshape(-1, QK)
    per_row = n // QK
    result = np.empty((values.shape[0], size), dtype=np.uint8) if out is None else out.reshape(-1, size)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=F).reshape(per_row, QK)
    encoder = _ENCODERS[ggml_type]
    if ggml_type in (Q3_K, Q6_K):
        chunk = _CHUNK_Q3 if ggml_type == Q3_K and qw is None else _CHUNK
    else:
        chunk = _CHUNK if qw is None else _CHUNK_QP
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, values.shape[0], chunk):
            # super-block b of the chunk weighted by its own slice of the row's importance: row (start + b) %
            # per_row of qw
            encoder(values[start:start + chunk], qw, start % per_row, result[start:start + chunk])
    return result.reshape(*rows.shape[:-1], per_row * size)
