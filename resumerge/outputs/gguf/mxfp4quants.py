"""GGUF's MXFP4 (layout and values: :mod:`resumerge.inputs.gguf.mxfp4blocks`) encoded to the bytes llama.cpp's
quantizer writes (``ggml_quantize_chunk``, ``quantize_row_mxfp4_ref``; it reads no importance matrix for it).

Each block of 32 values: ``e = floor(log2f(amax)) - 2 + 127`` (0 for an all-zero block), stored as C casts that
float to ``uint8_t`` on x86 (through int32, then the low byte: a block under 2^-125 wraps), and each value the code
whose ``k * 2^(e - 128)`` is nearest to it (``best_index_mxfp4``: the float32 distance ``|k d - x|``, the first
code of the smallest kept; so a tie goes to the code of the smaller magnitude, and -0 is never written). ``log2f``
is float32's correctly rounded log2 (the largest floats of a binade round up to its top: ``amax`` just under 16
gets ``e`` of 16), taken here through float64. This is not gpt-oss's MXFP4 rounding
(:mod:`resumerge.inputs.quant.mxfp4`: ties away from zero, the exponent exact), hence its own encoder.

Vectorised across blocks with numpy, the C search's 16 candidates in its order, so the bytes agree on finite
values (tests/test_gguf_mxfp4.py).
"""

from __future__ import annotations

import numpy as np

from resumerge.inputs.gguf.mxfp4blocks import MXFP4, MXFP4_BLOCK_BYTES, kvalues

__all__ = ["MXFP4_TYPES", "encode_mxfp4"]

_Array = np.ndarray
F = np.float32
# ggml type -> bytes a block (its values: MXFP4_BLOCK_BYTES)
MXFP4_TYPES = {MXFP4: MXFP4_BLOCK_BYTES[MXFP4][1]}
_BLOCK = 32
# blocks coded together: a chunk's working arrays stay in the cache
_CHUNK = 2048


def _exponents(amax: _Array) -> _Array:
    """The E8M0 byte (int64 (n,)) of each block's largest magnitude ``amax`` (float32 (n,))."""
    with np.errstate(divide="ignore"):
        log2 = np.floor(np.log2(amax.astype(np.float64)).astype(F))
    e = np.where(amax > 0, log2 - 2 + 127, 0).astype(np.int64)
    return e & 0xFF


def _codes(blocks: _Array, d: _Array) -> _Array:
    """Each value's code (int64 (n, 32)): the first of the nearest ``k * d``."""
    values = np.array(kvalues(), dtype=F)
    best = np.zeros(blocks.shape, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        error = np.abs(values[0] * d - blocks)
        for code in range(1, 16):
            trial = np.abs(values[code] * d - blocks)
            better = trial < error
            best[better] = code
            np.copyto(error, trial, where=better)
    return best


def encode_mxfp4(rows: _Array, ggml_type: int = MXFP4, importance: _Array | None = None,
                 out: _Array | None = None) -> _Array:
    """``rows`` (float32, last dimension whole blocks of 32) as MXFP4 bytes (uint8, one row of bytes per row),
    written into ``out`` when given; ``importance`` is not read (llama.cpp's quantizer reads none)."""
    size = MXFP4_TYPES[ggml_type]
    blocks = np.ascontiguousarray(rows, dtype=F).reshape(-1, _BLOCK)
    shape = (*rows.shape[:-1], rows.shape[-1] // _BLOCK * size)
    result = np.empty(shape, dtype=np.uint8) if out is None else out
    flat = result.reshape(-1, size)
    for start in range(0, blocks.shape[0], _CHUNK):
        chunk = blocks[start:start + _CHUNK]
        e = _exponents(np.abs(chunk).max(axis=1))
        d = np.ldexp(F(1), (e - 128).astype(np.int32)).astype(F)[:, None]  # 2^(e - 128), exact
        codes = _codes(chunk, d)
        flat[start:start + _CHUNK, 0] = e
        flat[start:start + _CHUNK, 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    return result
