"""How much a GGUF tensor's quantization costs the model, per candidate type: what ``--gguf-target-size`` chooses
each tensor's type by (:mod:`resumerge.merge.plan.ggufbudget`).

The weight error of storing weight ``W`` (rows × columns, the GGUF row a column count) as type ``t`` is the
relative error the quantized linear makes on its inputs, weighted by the importance matrix ``w`` (each column's mean
squared input over the texts, llama-imatrix's entry over its count):

    e(t) = Σ_j w_j Σ_i (W_ij − Q_t(W)_ij)² / Σ_j w_j Σ_i W_ij²

— the expected ‖(W − Q_t W) x‖² / ‖W x‖² over the texts' inputs ``x`` where their columns are uncorrelated (the
diagonal of their second moments, which is what the matrix keeps). ``Q_t`` is the encoder the GGUF is written with,
with the same importance weights, decoded back: the error measured is the one the file will have.

A weight error alone says nothing of how much the model's output moves: a query's error passes a softmax, a down
projection's is added to the residual stream; an early layer's error passes every layer after it. So the importance
pass (:class:`~resumerge.analyses.importance.sums.SumStep`) calibrates it on the texts: the layer is run again with
the matrix quantized as its :func:`probe_type`, and the cost at ``t`` is the squared error that made in the layer's
output, times ``e(t) / e(probe)``, times the gain of the layers after it (how much each amplifies an error entering
it, measured as it runs): the squared error the matrix's quantization as ``t`` puts where the last layer leaves,
which the final norm and the head turn into the KL the choice minimises (the sum over matrices: errors of
independent quantizations add in squares). ``bench/bench_gguf_target.py`` measures the KL it gets.

Sums in float64 numpy, one thread, chunk by chunk in order: a resumed pass measures the layers it had not
reached to the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from resumerge.inputs.gguf import ggmltypes as ggml
from resumerge.inputs.gguf.ggmltypes import TYPES

if TYPE_CHECKING:
    from resumerge.machine.torch_import import torch

# The types a size target chooses among, by row: the K-quants and the i-quants publishers ship below 4 bits where a
# row is whole 256-value blocks, down to the 1-bit ones (IQ1_S and IQ1_M need an importance matrix, which a target
# always has: its costs are measured in the pass that computes it); else the 32-value ones llama.cpp's quantizer
# falls them back to on such rows (the legacy types and IQ4_NL, which the i-quants fall back to); Q8_0 on both.
K_CANDIDATES = (ggml.IQ1_S, ggml.IQ1_M, ggml.IQ2_XXS, ggml.IQ2_XS, ggml.IQ2_S, ggml.Q2_K, ggml.IQ3_XXS, ggml.IQ3_S,
                ggml.Q3_K, ggml.IQ4_XS, ggml.Q4_K, ggml.Q5_K, ggml.Q6_K, ggml.Q8_0)
LEGACY_CANDIDATES = (ggml.Q4_0, ggml.IQ4_NL, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0)
# The type whose error a matrix's output is measured with (:func:`probe_type`), by row as above: the lowest K-quant
# llama.cpp's mixes use, the lowest 32-value type.
K_PROBE, LEGACY_PROBE = ggml.Q3_K, ggml.Q4_0


def candidate_types(row: int) -> tuple[int, ...]:
    """The types a tensor whose rows hold ``row`` values may be chosen as (none where a row is not whole 32-value
    blocks: it stays as its mix writes it)."""
    if row % TYPES[ggml.Q2_K].values == 0:
        return K_CANDIDATES
    if row % TYPES[ggml.Q8_0].values == 0:
        return LEGACY_CANDIDATES
    return ()


def probe_type(types: Sequence[int]) -> int:
    """The type of ``types`` (a row's :func:`candidate_types`) a matrix's output error is measured at: its cost at
    each type is that error scaled by the type's weight error over the probe's."""
    return K_PROBE if K_PROBE in types else LEGACY_PROBE


def type_bytes(ggml_type: int, shape: Sequence[int]) -> int:
    """The bytes of a tensor of (row-major) ``shape`` stored as block type ``ggml_type``."""
    values, size = TYPES[ggml_type].block
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    return rows * (int(shape[-1]) // values) * size


def quantization_costs(weight: torch.Tensor, importance: np.ndarray, types: Sequence[int]) -> np.ndarray:
    """The cost (float64, one per type of ``types``) of storing ``weight`` (float32 rows, CPU) as each type, with
    the importance weights ``importance`` (float32, one per column: the matrix's entry over its count). Measured
    :data:`CHUNK_VALUES` values of rows at a time (a type's blocks lie within a row): what it holds beside the
    weight is a few copies of a chunk, whatever the matrix's size."""
    from resumerge.inputs.gguf.blocks import decode
    from resumerge.inputs.kernels import serial_kernels
    from resumerge.outputs.gguf.encoders import encode

    rows = sampled_rows(weight.detach().to("cpu").float())
    w = np.asarray(importance, dtype=np.float64)
    weights = np.asarray(importance, dtype=np.float32)
    step = max(1, CHUNK_VALUES // max(int(rows.shape[-1]), 1))
    signal = 0.0
    errors = np.zeros(len(types), dtype=np.float64)
    # A chunk's decode (and Q8_0's encode) is a few dozen small torch kernels a type: split over torch's threads,
    # each waits for a core the pass's other work (or the machine's) holds, and spins there under OpenMP's default
    # active wait (one layer's 7 matrices of a tiny llama: 6.7 CPU s over two busy threads, 3.4 on one; the
    # i-quants' searches are numba's, one thread either way). Elementwise kernels: the same bits on any count.
    with serial_kernels():
        for start in range(0, int(rows.shape[0]), step):
            chunk = rows[start:start + step]
            values = chunk.numpy().astype(np.float64)
            signal += float(np.dot(np.square(values).sum(axis=0), w))
            for k, kind in enumerate(types):
                back = decode(encode(chunk, kind, importance=weights), kind).numpy()
                errors[k] += float(np.dot(np.square(values - back).sum(axis=0), w))
    return errors / signal if signal > 0.0 else np.zeros(len(types), dtype=np.float64)


def measuring_bytes(layers: Iterable[Iterable[Sequence[int]]], rerun: int, longest: int, hidden: int) -> int:
    """What the importance pass of a size target holds beside its layer's step and the hidden states while it
    measures a layer's matrices (:class:`~resumerge.analyses.importance.sums.SumStep`; ``layers``: each decoder
    layer's tensors' shapes, of which it measures the matrices whose rows are whole blocks of a candidate type), the
    layer run again on ``rerun`` tokens of texts (:class:`~resumerge.analyses.importance.sums.Rerun`: up to
    :data:`RERUN_TOKENS`), the ``longest`` text that many, of width ``hidden``; the most of any layer:

    - the layer's texts as it is entered again (float32), twice (its gain runs them moved);
    - beside them, a matrix's :func:`quantization_costs` (of a chunk of :data:`CHUNK_VALUES` values: its float64
      copy, its decoded values, their difference and its square; the rows sampled, where they are copied), or the
      matrix quantized as its probe (its blocks and float32 values) while the layer runs again on a text, the
      longest: the products of the widest matrix (three at once: a gate's, an up projection's and theirs) and the
      layer's output compared in float64.

    An 8B model's layer (its MLP 14,336 wide, of 4,096 columns) measured over texts of 512 tokens holds about
    0.5 GB of them."""
    most = 0
    for shapes in layers:
        measured = [tuple(int(d) for d in s) for s in shapes if len(s) == 2 and candidate_types(int(s[-1]))]
        if not measured:
            continue
        entered = 2 * 4 * rerun * hidden
        running = min(longest, rerun) * (3 * 4 * max(s[0] for s in measured) + 3 * 8 * hidden)
        for shape in measured:
            sampled = measured_values(shape)
            chunk = min(sampled, max(1, CHUNK_VALUES // shape[-1]) * shape[-1])
            costs = 28 * chunk + (4 * sampled if sampled < math.prod(shape) else 0)
            probe = probe_type(candidate_types(shape[-1]))
            quantized = 4 * math.prod(shape) + type_bytes(probe, shape)
            most = max(most, entered + max(costs, quantized + running))
    return most


def sampled_rows(weight: torch.Tensor) -> torch.Tensor:
    """The rows of ``weight`` a cost is measured on: every one up to :data:`MEASURED_ROWS`, else that many evenly
    spread (every k-th from the first): a relative error averaged over that many rows of thousands of values moves
    little, and a large model's matrices (tens of thousands of rows) cost no more to measure than a small one's."""
    count = int(weight.shape[0])
    stride = -(-count // MEASURED_ROWS)
    return (weight if stride == 1 else weight[::stride]).contiguous()


def measured_values(shape: Sequence[int]) -> int:
    """How many of a matrix of ``shape``'s values its costs are measured on (:func:`sampled_rows`)."""
    count = int(shape[0])
    return -(-count // -(-count // MEASURED_ROWS)) * int(shape[-1])


MEASURED_ROWS = 512
# The texts a layer is run on again to measure its matrices' output errors: the first ones, this many tokens or more.
RERUN_TOKENS = 4096
# Values of a matrix measured at a time (float64 copies of them, and a type's decoded values, are held).
CHUNK_VALUES = 1 << 20
