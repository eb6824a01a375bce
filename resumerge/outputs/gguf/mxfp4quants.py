"""GGUF's MXFP4 (layout and values: :mod:`resumerge.inputs.gguf.mxfp4blocks`) encoded to the bytes llama.cpp's
quantizer writes (``ggml_quantize_chunk``, ``quantize_row_mxfp4_ref``; it reads no importance matrix for it).

Each block of 32 values: ``e = floor(log2f(amax)) - 2 + 127`` (0 for an all-zero block), stored as C casts that
float to ``uint8_t`` on x86 (through int32, then the low byte: a block under 2^-125 wraps), and each value the code
whose ``k * 2^(e - 128)`` is nearest to it (``best_index_mxfp4``: the float32 distance ``|k d - x|``, the first
code of the smallest kept; so a tie goes to the code of the smaller magnitude, and -0 is never written). ``log2f``
is float32's correctly rounded log2 (the largest floats of a binade round up to its top: ``amax`` just under 16
gets ``e`` of 16), taken here through float64. This is not gpt-oss's MXFP4 rounding
(:mod:`resumerge.inputs.quant.mxfp4`: ties away from zero, the exponent exact), hence its own encoder.

Compiled where numba is (:mod:`.tqmxloop`: C's loop), else vectorised across blocks with numpy (the two candidates
that can win of C's 16: :func:`_codes`); the bytes agree on finite values (tests/test_gguf_mxfp4.py).
"""

from __future__ import annotations

import numpy as np

from resumerge.inputs.gguf.ggmltypes import MXFP4, TYPES
from resumerge.inputs.gguf.mxfp4blocks import kvalues
from resumerge.outputs.gguf import tqmxloop

__all__ = ["MXFP4_TYPES", "encode_mxfp4"]

_Array = np.ndarray
F = np.float32
# the ggml types this module encodes (its block: its row of resumerge.inputs.gguf.ggmltypes)
MXFP4_TYPES = (MXFP4,)
_BLOCK = 32
# blocks coded together: a chunk's working arrays stay in the cache
_CHUNK = 2048
# the codes' magnitudes (kvalues_mxfp4's 0 ... 7), in float64 to find a value's neighbours and float32 as C's
_MAGNITUDES = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float64)
_MAGNITUDES_F = _MAGNITUDES.astype(F)
# 2^(e - 128) for each E8M0 byte e (float32, exact: 2^-128 a subnormal)
_HALVES = np.ldexp(F(1), np.arange(-128, 128, dtype=np.int32)).astype(F)


def _exponents(amax: _Array) -> _Array:
    """The E8M0 byte (int64 (n,)) of each block's largest magnitude ``amax`` (float32 (n,))."""
    with np.errstate(divide="ignore"):
        log2 = np.floor(np.log2(amax.astype(np.float64)).astype(F))
    e = np.where(amax > 0, log2 - 2 + 127, 0).astype(np.int64)
    return e & 0xFF


def _codes(blocks: _Array, e: _Array) -> _Array:
    """Each value's code (int64 (n, 32)) of ``blocks`` with E8M0 bytes ``e`` (n,): the first of the nearest
    ``k * d``, ``d = 2^(e - 128)``.

    Not C's sixteen trials: for ``x >= 0`` a negative ``k`` is never nearer than code 0 (its distance ``x + |k| d``
    is at least ``x``, and a tie goes to the lower code), nor is the -0 of code 8; for ``x < 0`` alike with the
    positive ones. So the code is the nearest of the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (times ``d``) to ``|x|``,
    numbered 0 ... 7 for ``x >= 0`` and 0, 9 ... 15 below. The exact distances are unimodal in the magnitude and
    float32 rounding is monotonic, so the first nearest is one of the two magnitudes around ``|x|`` (at least ``d``
    apart from every other's distance, which no rounding closes): ``|x| / d`` (exact in float64) finds them, their
    float32 distances ``|k d - |x||`` (C's, up to the sign) choose, the lower on a tie. A NaN is code 0, as C's
    comparisons leave it."""
    magnitude = np.abs(blocks)
    scaled = magnitude.astype(np.float64) * np.ldexp(1.0, 128 - e)[:, None]  # |x| / d, exact
    below = np.clip(np.searchsorted(_MAGNITUDES, scaled, side="right") - 1, 0, 7)
    above = np.minimum(below + 1, 7)
    d = _HALVES[e][:, None]  # 2^(e - 128)
    with np.errstate(over="ignore", invalid="ignore"):
        nearer_above = np.abs(_MAGNITUDES_F[above] * d - magnitude) < np.abs(_MAGNITUDES_F[below] * d - magnitude)
    chosen = np.where(nearer_above, above, below)
    codes: _Array = np.where((blocks < 0) & (chosen > 0), chosen + 8, chosen)
    codes[np.isnan(blocks)] = 0
    return codes


def encode_mxfp4(rows: _Array, ggml_type: int = MXFP4, importance: _Array | None = None,
                 out: _Array | None = None) -> _Array:
    """``rows`` (float32, last dimension whole blocks of 32) as MXFP4 bytes (uint8, one row of bytes per row),
    written into ``out`` when given; ``importance`` is not read (llama.cpp's quantizer reads none)."""
    size = TYPES[ggml_type].size
    blocks = np.ascontiguousarray(rows, dtype=F).reshape(-1, _BLOCK)
    shape = (*rows.shape[:-1], rows.shape[-1] // _BLOCK * size)
    result = np.empty(shape, dtype=np.uint8) if out is None else out
    flat = result.reshape(-1, size)
    compiled = tqmxloop.kernels()
    if compiled is not None:
        compiled.mxfp4(blocks, np.array(kvalues(), dtype=F), _HALVES, flat)
        return result
    for start in range(0, blocks.shape[0], _CHUNK):
        chunk = blocks[start:start + _CHUNK]
        e = _exponents(np.abs(chunk).max(axis=1))
        codes = _codes(chunk, e)
        flat[start:start + _CHUNK, 0] = e
        flat[start:start + _CHUNK, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    return result
