"""The legacy types' importance paths (``quantize_row_q{4,5}_{0,1}_impl``): llama-quantize uses them for a legacy
file's tensors, and for a K mix's fallbacks (rows that are not whole 256-value blocks), when it has an importance
matrix. They search with the K-quants' own scale searches (:mod:`.ksearch`: ``qkx`` for the affine types, ``qx``
for the symmetric), float32 in llama.cpp's order as there.
"""

from __future__ import annotations

import numpy as np

from resumerge.inputs.gguf.ggmltypes import TYPES
from resumerge.inputs.gguf.legacy import KINDS
from resumerge.outputs.gguf.ksearch import F, f16, fsum, qkx, qx

_Array = np.ndarray

# the types encoded here: the legacy ones (their layouts: resumerge.inputs.gguf.legacy)
LEGACY = frozenset(KINDS)
_ROWS = 64  # rows coded together


def _legacy_rows(rows: _Array, ggml_type: int, qw: _Array) -> _Array:
    """The bytes of ``rows`` (float32, (R, C)) as a legacy type with importance ``qw`` (C,): (R, C/32 * size).
    Each block's weights are ``qw * sqrt(sigma2 + x²)`` with sigma2 the mean square of its whole row."""
    kind, size = KINDS[ggml_type], TYPES[ggml_type].size
    affine = kind.affine
    nmax = kind.levels if affine else (kind.levels + 1) // 2  # the symmetric types search -nmax ... nmax - 1
    r, c = rows.shape
    sigma2 = fsum(np.ascontiguousarray(rows.T) ** 2) / F(c)
    per_row = c // 32
    xt = np.ascontiguousarray(rows.reshape(r * per_row, 32).T)  # (32, blocks), block b = row b // per_row
    w = np.tile(qw.reshape(per_row, 32).T, (1, r)) * np.sqrt(np.repeat(sigma2, per_row)[None, :] + xt * xt)
    out = np.zeros((r * per_row, size), dtype=np.uint8)
    if affine:
        scale, the_min, codes = qkx(xt, w, nmax, -0.9, 0.05, 36, mad=False, v3=True)
        out[:, 0:2] = f16(scale)[0].view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = f16(-the_min)[0].view(np.uint8).reshape(-1, 2)
    else:
        scale, codes = qx(xt, nmax, w)
        out[:, 0:2] = f16(scale)[0].view(np.uint8).reshape(-1, 2)
    q = codes.T.astype(np.uint8)  # (blocks, 32)
    out[:, -16:] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    if nmax > 15:  # the fifth bits, bit k of the 32-bit word for value k
        bits = (q >> 4).reshape(-1, 4, 8) << np.arange(8, dtype=np.uint8)
        out[:, size - 20:size - 16] = np.bitwise_or.reduce(bits, axis=2)
    return out.reshape(r, per_row * size)


def encode_legacy_weighted(rows: _Array, ggml_type: int, importance: _Array, out: _Array | None = None) -> _Array:
    """llama.cpp's bytes of ``rows`` (float32, (..., n), n whole 32-value blocks) as legacy type ``ggml_type``
    (Q4_0, Q4_1, Q5_0, Q5_1) with the per-column ``importance`` (float32, (n,)): uint8 (..., n / 32 * block bytes),
    into ``out`` when given."""
    size = TYPES[ggml_type].size
    n = rows.shape[-1]
    values = np.ascontiguousarray(rows, dtype=F).reshape(-1, n)
    result = np.empty((values.shape[0], n // 32 * size), dtype=np.uint8) if out is None else out.reshape(
        values.shape[0], n // 32 * size)
    qw = np.ascontiguousarray(importance, dtype=F)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, values.shape[0], _ROWS):
            result[start:start + _ROWS] = _legacy_rows(values[start:start + _ROWS], ggml_type, qw)
    return result.reshape(*rows.shape[:-1], n // 32 * size)
