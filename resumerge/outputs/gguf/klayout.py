"""The K-quant encoders' layouts in and out, compiled (numba, :mod:`.jit`): a chunk of super-blocks laid out
element-major for the searches with its sub-block weights, and the codes recomputed from the stored scales and
packed into the output's bytes.

:mod:`.kquants`' numpy path does each of these as several passes (a transpose to columns of super-blocks, a second
one to sub-blocks, the weights' squares, sums, roots and products each a temporary of the chunk's size; the codes'
division, rounding, clip and selection each another, a transpose back to super-blocks, then the packing's shifts and
ors), a tenth to two thirds of an encoding's CPU beside the searches once those were compiled
(bench/bench_kquant_glue.py). Here each is one pass, in the same float32 operations and order: every sum runs from 0
in index order as :func:`.ksearch.fsum`, every product and root is one float32 operation (numba types float32 with
float32 as float32; the constants are float32). The numpy path stays the reference: where numba is missing, or where
a ratio leaves the range in which ``nearest_int`` is round half to even (magnitudes near float32's ends, which
realistic weights never reach), the encoders take it, to the same bytes (``tests/test_gguf_klayout.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from resumerge.inputs.gguf.ggmltypes import Q2_K, Q3_K, Q4_K, Q5_K
from resumerge.outputs.gguf import jit
from resumerge.outputs.gguf import kfloat as kf

__all__ = ["ABS", "IMPORTANCE", "PLAIN", "QW", "RMS", "Kernels", "kernels"]

_Array = np.ndarray

# what :func:`_lay_out` writes as the weights beside the values
PLAIN = 0  # none
IMPORTANCE = 1  # qw * sqrt(sigma2 + x²), sigma2 = factor * Σx² / 256 of the super-block (_importance)
QW = 2  # qw itself, laid out as the values
RMS = 3  # sqrt(Σx² / n of the sub-block) + |x| (Q4_K / Q5_K without importance)
ABS = 4  # |x| (Q2_K without importance)

# super-blocks a kernel lays out at a time: a cache line of float32 each row of x is written in
_TILE = 16
# super-blocks :func:`_pack` packs at a time: a cache line of each row of uint8 codes read
_TILE_BYTES = 64


def _lay_out(block: _Array, qw: _Array, offset: int, n: int, mode: int, factor: float, x: _Array, w: _Array,
             sw: _Array) -> None:
    """Super-blocks ``block`` (B, 256) as sub-blocks of ``n`` values, element-major, into ``x`` (n, 256/n * B):
    sub-block j of super-block b in column ``j*B + b``; their weights as ``mode`` says into ``w`` (x's shape),
    and for IMPORTANCE each sub-block's Σw from 0 into ``sw`` (256/n * B). Super-block b's importance is row
    ``(offset + b) % len(qw)`` of ``qw`` (rows of 256). ``factor``: IMPORTANCE's, 1 meaning none applied.

    A tile of :data:`_TILE` super-blocks at a time, first transposed into a small buffer (read in order), then
    each of x's rows written from it a cache line at a time (x's rows and block's, a power of 2 apart, share a few
    cache sets: walking either across them thrashed)."""
    f32 = np.float32
    nb = block.shape[0]
    rows = qw.shape[0]
    groups = 256 // n
    scaled = factor != 1.0
    fac = f32(factor)
    total_n = f32(256.0)
    sub_n = f32(n)
    tile_t = np.empty((256, _TILE), dtype=np.float32)  # the tile's values, element-major
    weight_t = np.empty((256, _TILE), dtype=np.float32)  # and their importance (IMPORTANCE, QW)
    acc = np.empty(_TILE, dtype=np.float32)
    sigma2 = np.empty(_TILE, dtype=np.float32)
    for b0 in range(0, nb, _TILE):
        tile = min(_TILE, nb - b0)
        for t in range(tile):
            for e in range(256):
                tile_t[e, t] = block[b0 + t, e]
            if mode in (IMPORTANCE, QW):
                r = (offset + b0 + t) % rows
                for e in range(256):
                    weight_t[e, t] = qw[r, e]
        if mode == IMPORTANCE:  # each super-block's sum in index order, the tile's super-blocks side by side
            for t in range(tile):
                sigma2[t] = f32(0.0)
            for e in range(256):
                for t in range(tile):
                    v = tile_t[e, t]
                    sigma2[t] += v * v
            for t in range(tile):
                sigma2[t] = (fac * sigma2[t] if scaled else sigma2[t]) / total_n
        for j in range(groups):
            col = j * nb + b0
            if mode in (IMPORTANCE, RMS):
                for t in range(tile):
                    acc[t] = f32(0.0)
            if mode == RMS:
                for i in range(n):
                    for t in range(tile):
                        v = tile_t[j * n + i, t]
                        acc[t] += v * v
                for t in range(tile):
                    acc[t] = np.sqrt(acc[t] / sub_n)
            for i in range(n):  # a loop per mode, each branch-free, so that LLVM vectorises it
                e = j * n + i
                for t in range(tile):
                    x[i, col + t] = tile_t[e, t]
                if mode == IMPORTANCE:
                    for t in range(tile):
                        v = tile_t[e, t]
                        wv = weight_t[e, t] * np.sqrt(sigma2[t] + v * v)
                        w[i, col + t] = wv
                        acc[t] += wv
                elif mode == QW:
                    for t in range(tile):
                        w[i, col + t] = weight_t[e, t]
                elif mode == RMS:
                    for t in range(tile):
                        w[i, col + t] = acc[t] + abs(tile_t[e, t])
                elif mode == ABS:
                    for t in range(tile):
                        w[i, col + t] = abs(tile_t[e, t])
            if mode == IMPORTANCE:
                for t in range(tile):
                    sw[col + t] = acc[t]


def _recode(x: _Array, d: _Array, m: _Array, low: float, high: float, shift: float, out: _Array) -> bool:
    """:func:`.kquants._recode` (``m``: the offsets, zeros for a symmetric type, whose ``x + 0`` is ``x``) of
    the columns whose stored scale ``d`` is not 0, shifted by ``shift``, into ``out`` (x's shape, uint8); the
    other columns' bytes are left for the caller. False, with ``out`` partly written, where a ratio leaves
    nearest_int's round half to even range (or is NaN): the caller then takes the numpy path."""
    f32 = np.float32
    n, cols = x.shape
    lo, hi, sh, bound = f32(low), f32(high), f32(shift), f32(kf.EXACT)
    safe = np.empty(cols, dtype=np.float32)
    for c in range(cols):  # a column whose scale is 0 gives 0s here, replaced by the caller
        safe[c] = d[c] if d[c] != 0 else np.inf
    tame = True
    for i in range(n):
        for c in range(cols):
            ratio = (x[i, c] + m[c]) / safe[c]
            tame &= abs(ratio) <= bound
            out[i, c] = np.uint8(min(max(np.rint(ratio), lo), hi) + sh)
    return tame


def _high_bits(codes: _Array, shift: int, b0: int, tile: int, out: _Array, at: int) -> None:
    """Bit ``shift`` of each of a super-block's 256 codes (the one above the low bits: Q3_K's hmask, Q5_K's qh) as
    32 bytes at ``at`` of ``out``, for the ``tile`` super-blocks from ``b0``: value ``32 k + lane``'s bit at bit
    ``k`` of byte ``lane`` (:func:`_pack`'s layouts)."""
    n = codes.shape[0]
    nb = out.shape[0]
    for lane in range(32):
        for t in range(tile):
            byte = 0
            for k in range(8):
                e = 32 * k + lane
                byte |= (codes[e % n, (e // n) * nb + b0 + t] >> shift) << k
            out[b0 + t, at + lane] = byte


def _pack(codes: _Array, kind: int, out: _Array) -> None:
    """Codes (n, 256/n * B) uint8 (:func:`_lay_out`'s layout) packed as K type ``kind``'s quants into their
    bytes of ``out`` (B, block bytes): :func:`.kquants._pack`'s numpy code, a tile of super-blocks at a time
    (each read a cache line of a row of codes)."""
    n = codes.shape[0]
    nb = out.shape[0]
    for b0 in range(0, nb, _TILE_BYTES):
        tile = min(_TILE_BYTES, nb - b0)
        if kind in (Q2_K, Q3_K):  # Q2_K (qs at 16) / Q3_K (hmask at 0, qs at 32: the low 2 bits)
            at = 16 if kind == Q2_K else 32
            for h in range(2):
                for lane in range(32):
                    for t in range(tile):
                        byte = 0
                        for k in range(4):
                            e = 128 * h + 32 * k + lane
                            byte |= (codes[e % n, (e // n) * nb + b0 + t] & 3) << (2 * k)
                        out[b0 + t, at + 32 * h + lane] = byte
            if kind == Q3_K:
                _high_bits(codes, 2, b0, tile, out, 0)
        elif kind in (Q4_K, Q5_K):  # Q4_K (qs at 16) / Q5_K (qh at 16, qs at 48)
            at = 16 if kind == Q4_K else 48
            for g in range(4):
                for lane in range(32):
                    for t in range(tile):
                        e0 = 64 * g + lane
                        e1 = e0 + 32
                        low = codes[e0 % n, (e0 // n) * nb + b0 + t] & 0xF
                        high = codes[e1 % n, (e1 // n) * nb + b0 + t] & 0xF
                        out[b0 + t, at + 32 * g + lane] = low | (high << 4)
            if kind == Q5_K:
                _high_bits(codes, 4, b0, tile, out, 16)
        else:  # Q6_K: ql at 0, qh at 128
            for h in range(2):
                for lane in range(32):
                    for t in range(tile):
                        e = 128 * h + lane
                        c0 = codes[e % n, (e // n) * nb + b0 + t]
                        c1 = codes[(e + 32) % n, ((e + 32) // n) * nb + b0 + t]
                        c2 = codes[(e + 64) % n, ((e + 64) // n) * nb + b0 + t]
                        c3 = codes[(e + 96) % n, ((e + 96) // n) * nb + b0 + t]
                        out[b0 + t, 64 * h + lane] = (c0 & 0xF) | ((c2 & 0xF) << 4)
                        out[b0 + t, 64 * h + 32 + lane] = (c1 & 0xF) | ((c3 & 0xF) << 4)
                        out[b0 + t, 128 + 32 * h + lane] = (c0 >> 4) | ((c1 >> 4) << 2) | ((c2 >> 4) << 4) | \
                            ((c3 >> 4) << 6)


class Kernels(NamedTuple):
    """The compiled kernels (each the function of its name with a leading underscore)."""

    lay_out: Callable[..., None]
    recode: Callable[..., bool]
    pack: Callable[..., None]


# The compiled kernels, or None where numba is not there (checked on each call: a test that takes numba away takes
# these too).
kernels = jit.lazy_kernels(Kernels, _lay_out, _recode, _pack, helpers=(_high_bits,))
