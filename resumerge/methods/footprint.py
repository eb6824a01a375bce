"""How much memory each merge method works with, measured per element of the tensor it merges.

The memory governor admits a unit of work by its estimate (:func:`resumerge.plan.workunits.estimate_bytes`): the
stored inputs, any cast copies, the output buffer, and what the method allocates while it runs — this module's
part. One formula for every method (8 bytes per element, times the inputs plus one for the whole-tensor methods)
over-stated the sparsifying methods about twice and under-stated ``ram`` several times, so each method has its
own figures, measured on the CPU by ``tests/methods/footprint_cases.py`` (torch's profiler, replayed allocation by
allocation, plus numpy's selection copies) and fitted into :data:`_TABLE` by ``bench/method_footprint.py --fit``;
``tests/methods/test_footprint.py`` holds every registered method and dtype to them: never above the estimate,
and the estimate not above 1.6× the measurement.

A method's working set (its peak beyond its inputs, its result included) is ``fixed + per_input × inputs``
bytes per element, plus the bounded scratch of the methods that work block by block (SCE's variance, DELLA's
row ranking, RAM's blocks of positions), times :data:`MARGIN`, plus :data:`CALL_BYTES`. The figures depend on the
dtype the method sees: half types rank through float32 keys and accumulate in float32, so their working set is
not half of float32's. A bfloat16 or float16 ``torch.dot`` on the CPU allocates scratch per intra-op thread that
no per-element figure describes (up to 64 MiB a thread for bfloat16), added for the method that takes such dot
products (``karcher``). Figures are for the CPU; a GPU merge is admitted by the same numbers.

May import: nothing (pure arithmetic; torch only to read the thread count when a half-precision dot needs it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Measurements are exact for the shapes measured; the margin covers other shapes' rounding, allocator alignment
# and small changes to a method's code between measurements.
MARGIN = 1.25

_SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# What any call allocates whatever the tensor's size: scalars, weight vectors, index lists and their Python
# objects (measured: under 4.5 kB a call).
CALL_BYTES = 4096


@dataclass(frozen=True)
class Footprint:
    """A method's measured working set in one dtype, in bytes per element: ``fixed + per_input × inputs`` (inputs
    as :func:`counted_inputs` counts them), plus ``block`` and ``line`` bytes per element of its two kinds of
    bounded scratch (see :func:`scratch_elements`). ``lone`` replaces the sum when a base meets a single other
    input and the method just returns a copy of it (multislerp); ``phase`` gives the scratch its own phase."""

    fixed: float
    per_input: float
    block: float = 0.0
    line: float = 0.0
    lone: float | None = None
    # (fixed, per_input) of a scratch phase whose peak does not sit on the main one's: the estimate is then the
    # larger of the main phase and this phase plus the scratch, not their sum.
    phase: tuple[float, float] | None = None


# A table cell: (fixed, per_input), optionally followed by (block, line), then lone (or None) and phase.
Column = (tuple[float, float] | tuple[float, float, float, float] | tuple[float, float, float, float, float]
          | tuple[float, float, float, float, None, tuple[float, float]])


def _dtypes(*columns: Column) -> dict[str, Footprint]:
    """One table row: (fixed, per_input[, block, line[, lone or None[, phase]]]) for float32, bfloat16, float16 and
    float64."""
    return {dtype: Footprint(*column) for dtype, column in zip(("float32", "bfloat16", "float16", "float64"), columns,
                                                                strict=True)}


# Measured on torch 2.13 CPU, 2 intra-op threads, and printed by `bench/method_footprint.py --fit`: covering
# every parameter variant, with and without a base, before MARGIN. The per-input slope is the steepest step
# between measured input counts, so more inputs than measured stay covered; a negative offset goes with it.
_TABLE: dict[str, dict[str, Footprint]] = {
    # method: float32, bfloat16, float16, float64
    "arcee_fusion": _dtypes((16, 0), (18, 0), (18, 0), (36, 0)),
    "breadcrumbs": _dtypes((5, 4), (3.25, 3.5), (3.25, 3.5), (-7, 15.5)),
    "breadcrumbs_ties": _dtypes((3.75, 8.25), (2.25, 4), (2.25, 4), (8, 16)),
    "dare_linear": _dtypes((4.25, 4.25), (6, 2), (12, 2), (8.75, 8)),
    "dare_ties": _dtypes((4, 8), (2, 4), (12, 2), (8, 16)),
    "della": _dtypes(
        (5, 4, 17.75, 7.5, None, (-4.25, 5.75)),
        (3.25, 2, 16.75, 4),
        (9.75, 2, 10.25, 8),
        (3.75, 10.5, 27.25, 0.75),
    ),
    "della_linear": _dtypes((1.25, 4, 14.75, 8.25), (3.25, 2, 16.75, 4), (9.75, 2, 10.25, 8), (9.5, 8, 22.75, 4)),
    "karcher": _dtypes((12, 4), (6.5, 2), (9.5, 2), (24, 8)),
    "linear": _dtypes((4, 0), (8, 0), (8, 0), (8, 0)),
    "model_stock": _dtypes((11.5, 4.25), (6, 2.25), (6, 2.25), (23, 8.5)),
    "multislerp": _dtypes((12, 16, 0, 0, 4), (6, 8, 0, 0, 2), (6, 8, 0, 0, 2), (24, 32, 0, 0, 8)),
    "nearswap": _dtypes((20, 0), (10, 0), (10, 0), (40, 0)),
    "nuslerp": _dtypes((8, 8), (4, 4), (4, 4), (16, 16.25)),
    "passthrough": _dtypes((4, 0), (2, 0), (2, 0), (8, 0)),
    "ram": _dtypes((4, 0, 8, 8), (1.75, 0.25, 4, 4, None, (2, 0)), (1.75, 0.25, 4, 4, None, (2, 0)), (8, 0, 16, 16)),
    "ramplus_tl": _dtypes((4, 0, 16.25, 20), (4, 0, 16.25, 22.25), (4, 0, 16.25, 22.25), (8, 0, 28.25, 36.25)),
    "sce": _dtypes(
        (-4, 8, 40, 0, None, (0.25, 4)),
        (-8, 8, 40, 0, None, (1, 2)),
        (-8, 8, 40, 0, None, (0, 2)),
        (-8, 16, 39.75, 0, None, (0.25, 8)),
    ),
    "slerp": _dtypes((4, 0, 12, 0), (2, 0, 12, 0), (2, 0, 12, 0), (8, 0, 24, 0)),
    "task_arithmetic": _dtypes((4, 4), (2, 2), (2, 2), (8, 8)),
    "ties": _dtypes((3.75, 8.25), (6, 3), (6, 3), (8, 16)),
    # MoE upcycling's units (resumerge/moe): not measured by the harness, figured by hand with room to spare. A
    # copy with noise holds the draw, the product and the sum (three tensors); a fused expert tensor its output
    # (at most 4 bytes an element: float32 output; float64's 8) and one input's noised copy at a time (three
    # tensors of an input's size, at most half the output's elements).
    "moe_expert": _dtypes((12, 0), (6, 0), (6, 0), (24, 0)),
    "moe_fused_experts": _dtypes((10, 0), (7, 0), (7, 0), (20, 0)),
}

# A method never measured (a plugin): the old rule of thumb, a float64-sized temporary per input and one more.
DEFAULT = Footprint(8.0, 8.0)


def measured(method: str, dtype: str) -> bool:
    """Whether ``method`` has measured figures for ``dtype`` (otherwise :data:`DEFAULT` stands in)."""
    return dtype in _TABLE.get(method, {})


def footprint(method: str, dtype: str) -> Footprint:
    """The measured figures of ``method`` when it sees tensors of ``dtype`` (a torch dtype name), before
    :data:`MARGIN`; :data:`DEFAULT` for a method or dtype never measured."""
    return _TABLE.get(method, {}).get(dtype, DEFAULT)


# Methods whose working set grows with the models merged, not the inputs: multislerp's base only shifts the
# origin of the others.
_BY_MODELS = frozenset({"multislerp"})
# The block sizes of the methods that work block by block, copied from their modules (a test compares them):
# sce._VARIANCE_BLOCK, sparsify._ROW_BLOCK_ELEMENTS, ram._GRAIN and slerp._CHUNK_ELEMENTS.
_SCE_BLOCK, _DELLA_BLOCK, _RAM_GRAIN, _SLERP_CHUNK = 1 << 14, 1 << 17, 32_768, 1 << 20


def counted_inputs(method: str, inputs: int, *, base: bool) -> int:
    """The input count the figures of ``method`` are per: every input, or the models other than the base."""
    return inputs - 1 if base and method in _BY_MODELS else inputs


def scratch_elements(method: str, dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """How many elements ``method``'s two kinds of bounded scratch cover on a tensor of ``shape`` merged from
    ``inputs`` inputs: (block buffers, line buffers); (0, 0) for a method that has none.

    SCE's variance runs over blocks of positions (five float64 buffers); slerp converts 2²⁰-element chunks to
    its working dtype. DELLA ranks rows in blocks of about
    2¹⁷ elements, never less than one row, and keeps per-row probabilities and sort keys as long as a row (a
    1-D tensor is one row). RAM keeps [models, width] buffers of about 2¹⁵ elements in all and [width] vectors,
    width being 2¹⁵ / models positions; ``ram`` widens three or four half-precision models into one more such
    buffer in float32, counted as two more of the half type.
    """
    elements = math.prod(shape)
    row = shape[-1] if len(shape) >= 2 else elements
    if method == "sce":
        return min(elements, _SCE_BLOCK), 0
    if method == "slerp":
        return min(elements, _SLERP_CHUNK), 0
    if method in ("della", "della_linear"):
        return min(elements, max(_DELLA_BLOCK, row)), min(elements, row)
    if method in ("ram", "ramplus_tl"):
        models = max(1, inputs - 1)
        block = min(elements * models, _RAM_GRAIN)
        if method == "ram" and dtype in ("bfloat16", "float16") and 3 <= models <= 4:
            block *= 2
        return block, min(elements, _RAM_GRAIN // models)
    return 0, 0


def dot_scratch(method: str, dtype: str, elements: int, threads: int) -> int:
    """Scratch torch's CPU ``dot`` allocates for half types, for the methods that take such dot products.

    Measured on torch 2.x: none below 8192 elements; above, bfloat16 takes 128 bytes per element per intra-op
    thread up to 2¹⁹ elements (64 MiB a thread), float16 about 131 KiB a thread.
    """
    if method != "karcher" or elements < 8192:
        return 0
    if dtype == "bfloat16":
        return 128 * min(elements, 1 << 19) * threads
    if dtype == "float16":
        return 134_340 * threads
    return 0


def working_bytes(method: str, dtype: str, shape: Sequence[int], inputs: int, *, base: bool,
                  threads: int | None = None) -> int:
    """Bytes ``method`` allocates at its peak while merging ``inputs`` tensors of ``shape`` that it sees in
    ``dtype``, its result included, with :data:`MARGIN`; ``base`` says whether one of the inputs is the base.

    ``threads`` is torch's intra-op thread count (read from torch when a half-precision dot needs it and it is
    not given). Never less than one tensor of ``dtype``: every method returns a new tensor.
    """
    elements = math.prod(shape)
    figures = footprint(method, dtype)
    size = _SIZES.get(dtype, 8)
    counted = counted_inputs(method, inputs, base=base)
    per_element = figures.fixed + figures.per_input * counted
    if base and counted == 1 and figures.lone is not None:
        per_element = figures.lone
    block, line = scratch_elements(method, dtype, shape, inputs)
    scratch = figures.block * block + figures.line * line
    total = max(per_element * elements, float(size * elements))
    if figures.phase is None:
        total += scratch
    else:
        total = max(total, (figures.phase[0] + figures.phase[1] * counted) * elements + scratch)
    if dot_scratch(method, dtype, elements, 1):
        if threads is None:
            import torch  # already imported by whoever runs methods; the planner reaches here only for karcher

            threads = torch.get_num_threads()
        total += dot_scratch(method, dtype, elements, threads)
    return math.ceil(total * MARGIN) + CALL_BYTES
