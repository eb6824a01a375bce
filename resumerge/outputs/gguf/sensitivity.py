"""How much a GGUF tensor's quantization costs the model, per candidate type: what ``--gguf-target-size`` chooses
each tensor's type by (:mod:`resumerge.merge.plan.ggufbudget`).

The cost of storing weight ``W`` (rows × columns, the GGUF row a column count) as type ``t`` is the relative error
the quantized linear makes on its inputs, weighted by the importance matrix ``w`` (each column's mean squared
input over the texts, llama-imatrix's entry over its count):

    cost(t) = Σ_j w_j Σ_i (W_ij − Q_t(W)_ij)² / Σ_j w_j Σ_i W_ij²

— the expected ‖(W − Q_t W) x‖² / ‖W x‖² over the texts' inputs ``x`` where their columns are uncorrelated (the
diagonal of their second moments, which is what the matrix keeps). ``Q_t`` is the encoder the GGUF is written with,
with the same importance weights, decoded back: the error measured is the one the file will have. A relative error
makes the linears of a layer comparable (an absolute one is in each output's own units); that their sum predicts the
KL of the output distribution is the choice's assumption, which ``bench/bench_gguf_target.py`` measures.

Sums in float64 numpy, one thread: a resumed pass measures the layers it had not reached to the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from resumerge.inputs.gguf.blocks import BLOCK_BYTES, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

if TYPE_CHECKING:
    from resumerge.torch_import import torch

# The types a size target chooses among, by row: the K-quants where a row is whole 256-value blocks; else the
# legacy 32-value ones (llama.cpp's quantizer falls a K type back to them on such rows); Q8_0 on both.
K_CANDIDATES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0)
LEGACY_CANDIDATES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)


def candidate_types(row: int) -> tuple[int, ...]:
    """The types a tensor whose rows hold ``row`` values may be chosen as (none where a row is not whole 32-value
    blocks: it stays as its mix writes it)."""
    if row % BLOCK_BYTES[Q2_K][0] == 0:
        return K_CANDIDATES
    if row % BLOCK_BYTES[Q8_0][0] == 0:
        return LEGACY_CANDIDATES
    return ()


def type_bytes(ggml_type: int, shape: Sequence[int]) -> int:
    """The bytes of a tensor of (row-major) ``shape`` stored as block type ``ggml_type``."""
    values, size = BLOCK_BYTES[ggml_type]
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    return rows * (int(shape[-1]) // values) * size


def quantization_costs(weight: torch.Tensor, importance: np.ndarray, types: Sequence[int]) -> np.ndarray:
    """The cost (float64, one per type of ``types``) of storing ``weight`` (float32 rows, CPU) as each type, with
    the importance weights ``importance`` (float32, one per column: the matrix's entry over its count)."""
    from resumerge.inputs.gguf.blocks import decode
    from resumerge.outputs.gguf.encoders import encode

    rows = weight.detach().to("cpu").float().contiguous()
    values = rows.numpy().astype(np.float64)
    w = np.asarray(importance, dtype=np.float64)
    signal = float(np.dot(np.square(values).sum(axis=0), w))
    costs = np.zeros(len(types), dtype=np.float64)
    if signal <= 0.0:
        return costs
    weights = np.asarray(importance, dtype=np.float32)
    for k, kind in enumerate(types):
        back = decode(encode(rows, kind, importance=weights), kind).numpy().astype(np.float64)
        costs[k] = float(np.dot(np.square(values - back).sum(axis=0), w)) / signal
    return costs
