"""GGUF's 2-bit i-quants (IQ2_XXS, IQ2_XS, IQ2_S) encoded to the bytes llama.cpp's quantizer writes
(``ggml_quantize_chunk``: ``quantize_iq2_xxs``, ``quantize_iq2_xs``, ``quantize_iq2_s``), the work in
:mod:`.iq2loop`'s kernels over :mod:`.iq2grid`'s tables (layouts: :mod:`resumerge.inputs.gguf.iq2blocks`).

IQ2_XXS and IQ2_XS need an importance matrix (ggml asserts one): :func:`encode` raises ValueError without one.
IQ2_S takes one too, and has ggml's weights without (llama.cpp's quantizer still refuses its files without a
matrix; that refusal is the plan's: :func:`resumerge.merge.plan.gguftypes.requires_imatrix`). IQ2_XXS's first
scale of each 32-value block is ``make_qp_quants``' (:func:`.ksearch.qp`, compiled or numpy, to the same bits).

Where numba is missing the same steps run vectorised in numpy (:mod:`.iq2numpy`), to the same bytes.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from resumerge.inputs.gguf.ggmltypes import IQ2_S, IQ2_XS, IQ2_XXS
from resumerge.outputs.gguf import iq2grid, iq2loop, iq2numpy
from resumerge.outputs.gguf import ksearch as ks
from resumerge.outputs.gguf.kfloat import F

__all__ = ["IQ2_TYPES", "encode"]

_Array = np.ndarray

# ggml type -> the kernels' kind (its row: resumerge.inputs.gguf.ggmltypes)
_KINDS = MappingProxyType({IQ2_XXS: iq2loop.XXS, IQ2_XS: iq2loop.XS, IQ2_S: iq2loop.S})
# the types encode encodes
IQ2_TYPES = tuple(_KINDS)


def encode(ggml_type: int, block: _Array, qw: _Array | None, offset: int, out: _Array) -> None:
    """Super-blocks ``block`` (float32 (B, 256)) as ``ggml_type`` into ``out`` (uint8 (B, block bytes)), super-block
    b weighted by row ``(offset + b) % len(qw)`` of ``qw`` (float32, rows of 256: the row's importance), or
    without a matrix (IQ2_S only)."""
    kind = _KINDS[ggml_type]
    if qw is None and kind != iq2loop.S:
        raise ValueError("IQ2_XXS and IQ2_XS need an importance matrix (llama.cpp's quantizer asserts one)")
    tables = iq2grid.tables(ggml_type)
    arrays = (tables.grid, tables.kmap, tables.neighbours)
    kernels = iq2loop.kernels()
    if kernels is None:
        d = iq2numpy.encode(block, qw, offset, kind, arrays, out[:, 2:])
    else:
        b = block.shape[0]
        weights = np.empty((0, 256), dtype=F) if qw is None else qw
        xval, weight, waux = (np.empty((b, 256), dtype=F) for _ in range(3))
        signs = np.empty((b, 32), dtype=np.uint8)
        kernels.prepare(block, weights, offset, kind, xval, weight, waux, signs)
        start = np.zeros((b, 8), dtype=F)
        if kind == iq2loop.XXS:
            kernels.start(xval, weight, start)
        d = np.empty(b, dtype=F)
        # the codes into a buffer of their own, copied after: out[:, 2:] is a strided view (C-contiguous where it is
        # one row), and numba would compile the kernel again for each layout (3 CPU s)
        codes = np.empty((b, out.shape[1] - 2), dtype=np.uint8)
        kernels.search(xval, weight, waux, signs, start, kind, arrays, codes, d)
        out[:, 2:] = codes
    out[:, 0:2] = ks.f16(d)[0].view(np.uint8).reshape(-1, 2)
