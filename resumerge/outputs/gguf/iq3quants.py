"""GGUF's 3-bit i-quants (IQ3_XXS, IQ3_S) encoded to the bytes llama.cpp's quantizer writes (``ggml_quantize_chunk``:
``quantize_iq3_xxs``, ``quantize_iq3_s``), with or without an importance matrix (``shared/reference/iquants.md`` §1).

Both code a 256-value super-block as eight blocks of 32, each block as eight quadruples of magnitudes, each a point
of a D4-lattice grid (:mod:`resumerge.inputs.gguf.iq3grid`: 256 points a byte, or 512 a byte and a high bit), signs
apart, times the block's scale, a 4-bit multiple of the super-block's float16 ``d``. IQ3_XXS (98 bytes) keeps seven
sign bits per eight values (the eighth makes the count of minus signs even: the value of least weighted square
gives way) and the scale in the top four bits of the signs' word; IQ3_S (110 bytes) keeps all eight signs, the high
bits of its indices and its scales apart.

llama.cpp finds each block's scale by trying inverse scales ``(15 + 0.2 s) / max`` (s within ±15 for IQ3_XXS, ±9
for IQ3_S), the magnitudes rounded to levels ``nearest_int((id·|x| - 1) / 2)`` within 0 ... 7, a quadruple off the
grid replaced by its neighbour (:mod:`.iq3neighbours`) of least error weighted by the roots of the weights, each
candidate's fit ``Σwxq / Σwq²`` adopted on a strict improvement; then, where a quadruple of the adopted codes was
off the grid, the codes rounded again at the adopted scale (IQ3_XXS: only those quadruples) and the scale fitted
once more. The weights are ``x²`` without a matrix, else ``qw · sqrt(σ² + x²)``, σ² the super-block's mean square
times 2. ``d`` is the largest block scale / 31 times a fudge factor (1.0125, 1.033) and each block's 4-bit scale
``nearest_int((scale / (max / 31) - 1) / 2)``. Two of llama.cpp's quirks are kept: IQ3_S's empty block (its values
all 0) does not advance where the next block's codes and signs are written, and IQ3_XXS's block counts as empty
under a largest magnitude of 1e-8.

The numpy path vectorises across blocks, values laid out element-major (32, S) so that each sum is
:func:`.ksearch.fsum`'s sequential one; where numba is installed the compiled kernel (:mod:`.iq3loop`) runs C's
scalar loop instead, to the same bits.
"""

from __future__ import annotations

import numpy as np

from resumerge.inputs.gguf.blocks import BLOCK_BYTES, IQ3_S, IQ3_XXS
from resumerge.outputs.gguf import iq3loop
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.iq3neighbours import Neighbours, neighbours
from resumerge.outputs.gguf.kfloat import F

__all__ = ["I3_TYPES", "encode_iq3"]

_Array = np.ndarray

# ggml type -> bytes a block
I3_TYPES = {IQ3_XXS: BLOCK_BYTES[IQ3_XXS][1], IQ3_S: BLOCK_BYTES[IQ3_S][1]}
_GRID = {IQ3_XXS: 256, IQ3_S: 512}
_FUDGE = {IQ3_XXS: F(1.0125), IQ3_S: F(1.033)}
_QK = 256
# super-blocks coded together: a chunk's working arrays stay small
_CHUNK = 256


def _encode_chunk(block: _Array, qw: _Array | None, offset: int, ggml_type: int, out: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as ``ggml_type`` into ``out`` (uint8 (B, bytes)): super-block b
    weighted by row ``(offset + b) % len(qw)`` of ``qw``, or by x² without one."""
    grid = neighbours(_GRID[ggml_type])
    xxs = ggml_type == IQ3_XXS
    d = np.zeros(block.shape[0], dtype=F)
    kernels = iq3loop.kernels()
    if kernels is not None:
        kernels.encode(block, np.empty((0, _QK), dtype=F) if qw is None else qw, offset, xxs, grid.odd, grid.levels,
                       grid.kmap, grid.flat, out, d)
    else:
        weights = None if qw is None else qw[(offset + np.arange(block.shape[0])) % qw.shape[0]]
        _encode_numpy(block, weights, xxs, grid, out, d)
    out[:, 0:2] = ks.f16(d)[0].view(np.uint8).reshape(-1, 2)


def _encode_numpy(block: _Array, qw: _Array | None, xxs: bool, grid: Neighbours, out: _Array, d: _Array) -> None:
    raise NotImplementedError


def encode_iq3(rows: _Array, ggml_type: int, importance: _Array | None = None, out: _Array | None = None) -> _Array:
    """llama.cpp's bytes of ``rows`` (float32, (..., n), n whole 256-value super-blocks) as IQ3_XXS or IQ3_S:
    uint8 (..., n / 256 * block bytes), into ``out`` when given (uint8, contiguous, of that many bytes).
    ``importance`` (float32, (n,)): llama.cpp's per-column importance for this tensor (an imatrix entry over its
    count), or None for the quantizer's path without one."""
    size = I3_TYPES[ggml_type]
    n = rows.shape[-1]
    per_row = n // _QK
    values = np.ascontiguousarray(rows, dtype=F).reshape(-1, _QK)
    result = np.empty((values.shape[0], size), dtype=np.uint8) if out is None else out.reshape(-1, size)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=F).reshape(per_row, _QK)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, values.shape[0], _CHUNK):
            _encode_chunk(values[start:start + _CHUNK], qw, start % per_row, ggml_type,
                          result[start:start + _CHUNK])
    return result.reshape(*rows.shape[:-1], per_row * size)
