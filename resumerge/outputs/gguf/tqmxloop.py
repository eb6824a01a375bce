"""The compiled twins of :mod:`.mxfp4quants`' and :mod:`.tquants`' numpy paths (MXFP4, TQ1_0, TQ2_0): llama.cpp's
scalar loops over each block, as numba compiles them (:mod:`.jit`), to the same bits.

MXFP4 (``quantize_row_mxfp4_ref``): the block's largest magnitude by C's strict ``<`` scan, its E8M0 byte from
float32's correctly rounded log2 (taken through float64, as the numpy path takes it) cast through int32 to its low
byte, then each value's code by C's sixteen trials in index order, adopted on a strict improvement of the float32
distance ``|k d - x|`` (a NaN keeps code 0). The ternary types (``quantize_row_tq*_ref``): the super-block's largest
magnitude, the float32 reciprocal, each value's trit ``lroundf(x * id) + 1`` (half away from zero; a non-finite
product trit 1, as x86's ``lroundf`` gives it), packed as the layouts say (:mod:`resumerge.inputs.gguf.tqblocks`).
The float16 ``d`` of a ternary block is the caller's (numpy's rounding, the numpy path's).

This module imports numpy and :mod:`.jit` only; numba itself is imported by :mod:`.jit` on the first
:func:`kernels` call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from resumerge.outputs.gguf import jit

__all__ = ["Kernels", "kernels"]

_Array = np.ndarray


class Kernels(NamedTuple):
    """The compiled kernels (documented at their plain functions below)."""

    mxfp4: Callable[[_Array, _Array, _Array, _Array], None]
    ternary: Callable[[_Array, bool, _Array, _Array], None]


def _amax(block: _Array) -> np.float32:
    """The largest magnitude of ``block`` (float32), by C's strict ``<`` scan from 0 (a NaN is never taken)."""
    amax: np.float32 = np.float32(0.0)
    for j in range(block.shape[0]):
        v = abs(block[j])
        if amax < v:
            amax = v
    return amax


def _mxfp4(blocks: _Array, kvalues: _Array, halves: _Array, out: _Array) -> None:
    """Blocks ``blocks`` (float32 (n, 32)) as MXFP4 bytes into ``out`` (uint8 (n, 17)); ``kvalues`` the 16 codes'
    values (float32), ``halves[e]`` ``2^(e - 128)`` (float32 (256,))."""
    f32 = np.float32
    for b in range(blocks.shape[0]):
        amax = _amax(blocks[b])
        e = 0
        if amax > 0 and amax < np.inf:
            e = (int(np.floor(f32(np.log2(np.float64(amax))))) - 2 + 127) & 0xFF
        d = halves[e]
        out[b, 0] = e
        for j in range(16):
            low = 0
            for half in range(2):
                x = blocks[b, j + 16 * half]
                best = 0
                error = abs(kvalues[0] * d - x)
                for code in range(1, 16):
                    trial = abs(kvalues[code] * d - x)
                    if trial < error:
                        best = code
                        error = trial
                if half == 0:
                    low = best
                else:
                    out[b, 1 + j] = low | (best << 4)


def _ternary(blocks: _Array, tq1: bool, out: _Array, d: _Array) -> None:
    """Super-blocks ``blocks`` (float32 (n, 256)) as TQ1_0 (``tq1``) or TQ2_0 bytes into ``out`` (uint8 (n, 54 or
    66)), all but the float16 ``d``, whose float32 (the largest magnitude) goes into ``d`` (n,)."""
    f32 = np.float32
    trits = np.empty(256, dtype=np.int64)
    for b in range(blocks.shape[0]):
        amax = _amax(blocks[b])
        d[b] = amax
        inverse = f32(1.0) / amax if amax != 0 else f32(0.0)
        for j in range(256):  # lroundf(x * id) + 1: half away from zero; trit 1 where not finite (x86's)
            y = f32(blocks[b, j] * inverse)
            trits[j] = 1
            if abs(y) < np.inf:
                whole = np.floor(abs(y))
                if abs(y) - whole >= f32(0.5):
                    whole += 1
                trits[j] = int(whole if y >= 0 else -whole) + 1
        if tq1:
            for m in range(32):  # bytes 0-31: values m + 32n
                q = 0
                for n in range(5):
                    q = q * 3 + trits[m + 32 * n]
                out[b, m] = (q * 256 + 242) // 243
            for m in range(16):  # bytes 32-47: values 160 + m + 16n
                q = 0
                for n in range(5):
                    q = q * 3 + trits[160 + m + 16 * n]
                out[b, 32 + m] = (q * 256 + 242) // 243
            for j in range(4):  # bytes 48-51: values 240 + j + 4n, the number times 3
                q = 0
                for n in range(4):
                    q = q * 3 + trits[240 + j + 4 * n]
                out[b, 48 + j] = (q * 3 * 256 + 242) // 243
        else:
            for h in range(2):
                for m in range(32):
                    at = 128 * h + m
                    out[b, 32 * h + m] = (trits[at] | (trits[at + 32] << 2) | (trits[at + 64] << 4)
                                          | (trits[at + 96] << 6))


kernels = jit.lazy_kernels(Kernels, _mxfp4, _ternary, helpers=(_amax,))
