"""GGUF's ternary types (TQ1_0, TQ2_0; layouts: :mod:`resumerge.inputs.gguf.tqblocks`) encoded to the bytes
llama.cpp's quantizer writes (``ggml_quantize_chunk``, ``quantize_row_tq1_0_ref``/``_tq2_0_ref``; it reads no
importance matrix for them).

Each super-block of 256 values: ``d`` its largest magnitude (stored float16), every value's trit
``lroundf(x * (1/d)) + 1`` (the product one float32 rounding by the float32 reciprocal, 0 where ``d`` is 0, then
rounded half away from zero). A ternary tensor — each block's values -d, 0 or d, as a BitNet b1.58 parent's — is
kept exactly (but for ``d``'s float16). Any other tensor is rounded as llama.cpp's quantizer rounds it: to
{-1, 0, 1} times its block's largest magnitude, every value under half of it to 0 (a normal weight matrix loses
most of itself: its round-trip error on normal values, ``GGUF_ROUND_TRIP``, is 81 %). resumerge writes what
llama-quantize would write of the same merge, and its plan says so (:data:`NOT_TERNARY`, in
:func:`resumerge.merge.plan.gguftypes.type_notes`): a merge of ternary parents is itself ternary only where the
method keeps each value one parent's (a passthrough, a slerp at t 0 or 1); an average of two ternary tensors is
not.

Compiled where numba is (:mod:`.tqmxloop`: C's loop), else vectorised across blocks with numpy, every step the C
loop's float32 operation; the bytes agree on finite values (tests/test_gguf_tquants.py).
"""

from __future__ import annotations

import numpy as np

from resumerge.inputs.gguf.ggmltypes import TQ1_0, TQ2_0, TYPES
from resumerge.outputs.gguf import tqmxloop

__all__ = ["NOT_TERNARY", "TQ_TYPES", "encode_tq"]

_Array = np.ndarray
F = np.float32
# the ggml types this module encodes (their blocks: their rows of resumerge.inputs.gguf.ggmltypes)
TQ_TYPES = (TQ1_0, TQ2_0)
_BLOCK = 256
# the plan's note of an output with ternary tensors (the merge's values are not known before it runs)
NOT_TERNARY = ("GGUF types: TQ1_0 and TQ2_0 keep a tensor exactly only where it is ternary (each 256 values -d, 0 "
               "or d, as a BitNet b1.58 parent's); any other merged tensor is rounded to that as llama.cpp's "
               "quantizer rounds it, each value under half its block's largest magnitude to 0 (a merge of ternary "
               "parents is ternary only where each value is one parent's: passthrough, not an average)")
# super-blocks coded together: a chunk's working arrays stay in the cache
_CHUNK = 256


def _trits(blocks: _Array) -> tuple[_Array, _Array]:
    """Each value's trit (0, 1, 2; int32 (n, 256)) and each block's ``d`` (float32 (n, 1)) of ``blocks``."""
    d = np.abs(blocks).max(axis=1, keepdims=True)
    inverse = np.zeros_like(d)
    with np.errstate(over="ignore", invalid="ignore"):
        np.divide(F(1), d, out=inverse, where=d != 0)
        y = blocks * inverse
        # lroundf: half away from zero, exactly (floor(|y| + 0.5) is not: the sum rounds 0.49999997 up)
        magnitude = np.abs(y)
        whole = np.floor(magnitude)
        whole += (magnitude - whole) >= F(0.5)
    # a block under 2^-128 has 1/d infinite: lroundf of ±inf or NaN is LONG_MIN on x86, whose int + 1 is trit 1
    whole[~np.isfinite(whole)] = 0
    return (np.copysign(whole, y).astype(np.int32) + 1), d


def _base3(trits: _Array) -> _Array:
    """The base-3 numbers (int32 (n, m)) of ``trits`` (n, k, m), the first of the k most significant."""
    number = np.zeros((trits.shape[0], trits.shape[2]), dtype=np.int32)
    for k in range(trits.shape[1]):
        number = number * 3 + trits[:, k]
    return number


def _tq1_0(trits: _Array, out: _Array) -> None:
    n = trits.shape[0]
    numbers = np.concatenate([_base3(trits[:, :160].reshape(n, 5, 32)), _base3(trits[:, 160:240].reshape(n, 5, 16)),
                              _base3(trits[:, 240:].reshape(n, 4, 4)) * 3], axis=1)
    out[:, :52] = (numbers * 256 + 242) // 243  # ceil(q * 256 / 243): trit n by multiplications (tqblocks)


def _tq2_0(trits: _Array, out: _Array) -> None:
    n = trits.shape[0]
    quads = trits.reshape(n, 2, 4, 32)
    packed = quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)
    out[:, :64] = packed.reshape(n, 64)


def encode_tq(rows: _Array, ggml_type: int, importance: _Array | None = None, out: _Array | None = None) -> _Array:
    """``rows`` (float32, last dimension whole super-blocks) as TQ1_0 or TQ2_0 bytes (uint8, one row of bytes per
    row), written into ``out`` when given; ``importance`` is not read (llama.cpp's quantizer reads none)."""
    size = TYPES[ggml_type].size
    blocks = np.ascontiguousarray(rows, dtype=F).reshape(-1, _BLOCK)
    shape = (*rows.shape[:-1], rows.shape[-1] // _BLOCK * size)
    result = np.empty(shape, dtype=np.uint8) if out is None else out
    flat = result.reshape(-1, size)
    pack = _tq1_0 if ggml_type == TQ1_0 else _tq2_0
    compiled = tqmxloop.kernels()
    if compiled is not None:
        d = np.empty(blocks.shape[0], dtype=F)
        compiled.ternary(blocks, ggml_type == TQ1_0, flat, d)
        with np.errstate(over="ignore"):
            flat[:, -2:] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        return result
    for start in range(0, blocks.shape[0], _CHUNK):
        trits, d = _trits(blocks[start:start + _CHUNK])
        chunk = flat[start:start + _CHUNK]
        pack(trits, chunk)
        with np.errstate(over="ignore"):  # d past float16's range is inf, as llama.cpp stores it
            chunk[:, -2:] = d.astype(np.float16).view(np.uint8)
    return result

