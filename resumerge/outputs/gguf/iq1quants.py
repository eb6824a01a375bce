"""GGUF's 1-bit i-quants (IQ1_S, IQ1_M) encoded to the bytes llama.cpp's quantizer writes (``ggml_quantize_chunk``:
``quantize_iq1_s``, ``quantize_iq1_m``), the work in :mod:`.iq1loop`'s kernel over the 1-bit grid's tables
(:func:`.iq2grid.build` of :func:`resumerge.inputs.gguf.iq1blocks.kgrid`, neighbours at the three nearest
distances; layouts: :mod:`resumerge.inputs.gguf.iq1blocks`).

IQ1_S needs an importance matrix (ggml asserts one): :func:`encode` raises ValueError without one. IQ1_M takes one
too, and has ggml's weights (x²) without (llama.cpp's quantizer still refuses its files without a matrix; that
refusal is the plan's: :func:`resumerge.merge.plan.gguftypes.requires_imatrix`). Where numba is missing the same
steps run vectorised in numpy (:mod:`.iq1numpy`), to the same bytes. The order of equal values in each block's
sort is glibc's (stable): :mod:`.iq1loop` says where another C library's could differ.
"""

from __future__ import annotations

import functools

import numpy as np

from resumerge.inputs.gguf import iq1blocks
from resumerge.inputs.gguf.ggmltypes import IQ1_M, IQ1_S
from resumerge.outputs.gguf import iq1loop, iq1numpy, iq2grid
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.kfloat import F

__all__ = ["IQ1_TYPES", "encode", "tables"]

_Array = np.ndarray
# ggml type -> bytes a block
IQ1_TYPES = (IQ1_S, IQ1_M)
_NWANT = 3  # neighbours at the nearest three distances (iq2xs_init_impl for the 1-bit types)


@functools.cache
def tables() -> tuple[_Array, _Array, _Array]:
    """The 1-bit grid's (grid, kmap, neighbours), built once a process on first use (about a second:
    2048 points), only where an IQ1 type is encoded."""
    built = iq2grid.build(iq1blocks.kgrid(), _NWANT)
    return built.grid, built.kmap, built.neighbours


def encode(ggml_type: int, block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as ``ggml_type`` into ``out`` (uint8 (B, block bytes)), super-block
    b weighted by row ``(offset + b) % len(qw)`` of ``qw`` (float32, rows of 256: the row's importance), or
    without a matrix (IQ1_M only)."""
    medium = ggml_type == IQ1_M
    if qw is None and ggml_type == IQ1_S:
        raise ValueError("IQ1_S needs an importance matrix (llama.cpp's quantizer asserts one)")
    kernels = iq1loop.kernels()
    d = np.empty(block.shape[0], dtype=F)
    if kernels is None:
        iq1numpy.encode(block, qw, offset, medium, tables(), out, d)
    else:
        kernels.encode(block, np.empty((0, 256), dtype=F) if qw is None else qw, offset, medium, tables(), out, d)
    bits = ks.f16(d)[0]
    if not medium:
        out[:, 0:2] = bits.view(np.uint8).reshape(-1, 2)
        return
    # IQ1_M: the float16's four nibbles in the top of the four scale words (bytes 49, 51, 53, 55)
    for j in range(4):
        out[:, 49 + 2 * j] |= (((bits >> (4 * j)) & 15) << 4).astype(np.uint8)
