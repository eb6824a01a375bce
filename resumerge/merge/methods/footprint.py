"""How much memory each merge method works with, measured per element of the tensor it merges.

The memory governor admits a unit of work by its estimate (:func:`resumerge.merge.plan.workunits.estimate_bytes`): the
stored inputs, any cast copies, the output buffer, and what the method allocates while it runs — this module's
part. One formula for every method (8 bytes per element, times the inputs plus one for the whole-tensor methods)
over-stated the sparsifying methods about twice and under-stated ``ram`` several times, so each method has its
own figures, measured on the CPU by ``tests/methods/footprint_cases.py`` (torch's profiler, replayed allocation by
allocation, plus numpy's selection copies) and fitted by ``bench/method_footprint.py --fit``. Each method declares
its figures in its spec (:attr:`MethodSpec.footprint <resumerge.merge.methods.spec.MethodSpec.footprint>`, a
:class:`MethodFootprint` made by :func:`measured`), so a new method cannot be declared without them;
``tests/methods/test_footprint.py`` holds every built-in method and dtype to them: never above the estimate,
and the estimate not above 1.6× the measurement. This module only evaluates a declared footprint.

A method's working set (its peak beyond its inputs, its result included) is ``fixed + per_input × inputs``
bytes per element, plus the bounded scratch of the methods that work block by block (SCE's variance, DELLA's
row ranking, RAM's blocks of positions: the method's :data:`ScratchRule`, built here from the block size the
method's own module uses), times :data:`MARGIN`, plus :data:`CALL_BYTES`. The figures depend on the
dtype the method sees: half types rank through float32 keys and accumulate in float32, so their working set is
not half of float32's. A bfloat16 or float16 ``torch.dot`` on the CPU allocates scratch per intra-op thread that
no per-element figure describes (up to 64 MiB a thread for bfloat16), added for the method that takes such dot
products (``half_dot``: ``karcher``). Figures are for the CPU; a GPU merge is admitted by the same numbers. A dtype
outside the four measured ones (an integer tensor merged as it is stored) gets :data:`UNMEASURED`, the old rule
of thumb.

May import: nothing (pure arithmetic; torch only to read the thread count when a half-precision dot needs it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, TypedDict

from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

# Measurements are exact for the shapes measured; the margin covers other shapes' rounding, allocator alignment
# and small changes to a method's code between measurements.
MARGIN = 1.25

_SIZES = MappingProxyType({"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2})
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


# A dtype none of the four measured ones (float32, bfloat16, float16, float64): the old rule of thumb, a
# float64-sized temporary per input and one more.
UNMEASURED = Footprint(8.0, 8.0)

MEASURED_DTYPES = ("float32", "bfloat16", "float16", "float64")

# (dtype the method sees, tensor shape, inputs) -> (block elements, line elements) of its bounded scratch.
ScratchRule = Callable[[str, Sequence[int], int], tuple[int, int]]


def dtype_size(dtype: str) -> int:
    """Bytes per element of the compute dtype named ``dtype`` (8 for a name it does not know: the widest)."""
    return _SIZES.get(dtype, 8)


def no_scratch(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """The rule of a method that has no bounded scratch: its working set is all per element."""
    return 0, 0


@dataclass(frozen=True)
class MethodFootprint:
    """What a method works with, as it declares at registration: its measured :class:`Footprint` in each of
    :data:`MEASURED_DTYPES`, its scratch rule (how many elements its block and line buffers cover on a tensor),
    whether its figures are per model other than the base rather than per input (``by_models``: multislerp's
    base only shifts the origin of the others), and whether it takes half-precision CPU dot products
    (``half_dot``, see :func:`dot_scratch`)."""

    by_dtype: Mapping[str, Footprint]
    scratch: ScratchRule = no_scratch
    by_models: bool = False
    half_dot: bool = False
    # The figures are per element of the (largest) input rather than of the result: a decomposition's working set
    # follows the matrix it factors, not its rank-r result (LoRA extraction's factor functions).
    of_inputs: bool = False
    # A rank-r decomposition's panels (a randomized range finder's sketches and their QR factors): ``panel`` bytes
    # per element of a (rows + cols) × ``panel_width(r)`` panel, r being the rank of the result (its shorter side).
    panel: float = 0.0
    panel_width: Callable[[int], int] | None = None
    # The method builds its result in the output dtype and returns it as the engine writes it, so its result is the
    # output buffer the engine counts already (MoE's plain expert stacks): no tensor of the dtype it sees is added.
    in_output: bool = False
    # A global boolean parameter that, when false, has the method take the tensor as a flat vector (the SVD methods'
    # ``svd``: a matrix they average allocates no singular vectors): the planner then sizes it by the 1-D figures.
    flat_unless: str = ""

    def figures(self, dtype: str) -> Footprint:
        """The figures for tensors of ``dtype`` (a torch dtype name), before :data:`MARGIN`; :data:`UNMEASURED`
        for a dtype outside :data:`MEASURED_DTYPES`."""
        return self.by_dtype.get(dtype, UNMEASURED)


# A cell: (fixed, per_input), optionally followed by (block, line), then lone (or None) and phase.
Column = (tuple[float, float] | tuple[float, float, float, float] | tuple[float, float, float, float, float]
          | tuple[float, float, float, float, None, tuple[float, float]])


class Traits(TypedDict, total=False):
    """What a method declares beside its figures, each a :class:`MethodFootprint` field of the same name and
    default (one record of them, so :func:`measured` does not repeat the eight as parameters of its own)."""

    scratch: ScratchRule
    by_models: bool
    half_dot: bool
    of_inputs: bool
    panel: float
    panel_width: Callable[[int], int] | None
    in_output: bool
    flat_unless: str


def measured(float32: Column, bfloat16: Column, float16: Column, float64: Column,
             **traits: Unpack[Traits]) -> MethodFootprint:
    """A method's footprint from its figures in each measured dtype, each (fixed, per_input[, block, line[, lone or
    None[, phase]]]) as ``bench/method_footprint.py --fit`` prints them (measured on torch 2.13 CPU, 2 intra-op
    threads, covering every parameter variant, with and without a base, before :data:`MARGIN`; the per-input
    slope is the steepest step between measured input counts, so more inputs than measured stay covered, and a
    negative offset goes with it), and its ``traits`` (:class:`Traits`: ``scratch=``, ``half_dot=``, ...)."""
    columns = (float32, bfloat16, float16, float64)
    by_dtype = {dtype: Footprint(*column) for dtype, column in zip(MEASURED_DTYPES, columns, strict=True)}
    return MethodFootprint(MappingProxyType(by_dtype), **traits)


def block_scratch(block: int) -> ScratchRule:
    """Block buffers of at most ``block`` elements (SCE's variance over blocks of positions, five float64
    buffers; slerp's chunks converted to its working dtype)."""

    def rule(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
        return min(math.prod(shape), block), 0

    return rule


def row_block_scratch(block: int) -> ScratchRule:
    """DELLA's: rows ranked in blocks of about ``block`` elements, never less than one row, with per-row
    probabilities and sort keys as long as a row (a 1-D tensor is one row)."""

    def rule(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
        elements = math.prod(shape)
        row = shape[-1] if len(shape) >= 2 else elements
        return min(elements, max(block, row)), min(elements, row)

    return rule


def model_block_scratch(grain: int, *, widen_half: bool) -> ScratchRule:
    """RAM's: [models, width] buffers of about ``grain`` elements in all and [width] vectors, width being
    ``grain`` / models positions; with ``widen_half`` three or four half-precision models are widened into one
    more such buffer in float32, counted as two more of the half type (``ram``, not ``ramplus_tl``)."""

    def rule(dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
        elements = math.prod(shape)
        models = max(1, inputs - 1)
        block = min(elements * models, grain)
        if widen_half and dtype in ("bfloat16", "float16") and 3 <= models <= 4:
            block *= 2
        return block, min(elements, grain // models)

    return rule


def counted_inputs(footprint: MethodFootprint, inputs: int, *, base: bool) -> int:
    """The input count the figures are per: every input, or the models other than the base (``by_models``)."""
    return inputs - 1 if base and footprint.by_models else inputs


def scratch_elements(footprint: MethodFootprint, dtype: str, shape: Sequence[int], inputs: int) -> tuple[int, int]:
    """How many elements the two kinds of bounded scratch cover on a tensor of ``shape`` merged from ``inputs``
    inputs: (block buffers, line buffers); (0, 0) for a method that has none."""
    return footprint.scratch(dtype, shape, inputs)


def dot_scratch(footprint: MethodFootprint, dtype: str, elements: int, threads: int) -> int:
    """Scratch torch's CPU ``dot`` allocates for half types, for the methods that take such dot products.

    Measured on torch 2.x: none below 8192 elements; above, bfloat16 takes 128 bytes per element per intra-op
    thread up to 2¹⁹ elements (64 MiB a thread), float16 about 131 KiB a thread.
    """
    if not footprint.half_dot or elements < 8192:
        return 0
    if dtype == "bfloat16":
        return 128 * min(elements, 1 << 19) * threads
    if dtype == "float16":
        return 134_340 * threads
    return 0


def working_bytes(footprint: MethodFootprint, dtype: str, shape: Sequence[int], inputs: int, *, base: bool,
                  threads: int | None = None, rank: int | None = None) -> int:
    """Bytes a method with ``footprint`` allocates at its peak while merging ``inputs`` tensors of ``shape`` that it
    sees in ``dtype``, its result included, with :data:`MARGIN`; ``base`` says whether one of the inputs is the
    base.

    ``threads`` is torch's intra-op thread count where the method runs (read from this process's torch when a
    half-precision dot needs it and it is not given: a process that only plans passes it, and imports no torch).
    Never less than one tensor of ``dtype`` (every method returns a new tensor), but for a footprint ``of_inputs``,
    whose result is a decomposition's factor. ``rank`` is a decomposition's rank, for a footprint with panels
    (``shape`` is then the matrix it factors).
    """
    elements = math.prod(shape)
    figures = footprint.figures(dtype)
    size = dtype_size(dtype)
    counted = counted_inputs(footprint, inputs, base=base)
    per_element = figures.fixed + figures.per_input * counted
    if base and counted == 1 and figures.lone is not None:
        per_element = figures.lone
    block, line = scratch_elements(footprint, dtype, shape, inputs)
    scratch = figures.block * block + figures.line * line
    # A decomposition's result is a rank-r factor, not a tensor of the matrix's size, and a result built in the
    # output buffer is that buffer (the caller counts both).
    own_result = footprint.of_inputs or footprint.in_output
    total = per_element * elements if own_result else max(per_element * elements, float(size * elements))
    if footprint.panel and footprint.panel_width is not None and rank is not None and len(shape) == 2:
        scratch += footprint.panel * (shape[0] + shape[1]) * footprint.panel_width(rank)
    if figures.phase is None:
        total += scratch
    else:
        total = max(total, (figures.phase[0] + figures.phase[1] * counted) * elements + scratch)
    if dot_scratch(footprint, dtype, elements, 1):
        if threads is None:  # the process that runs the methods: torch with its pending -j count (see torch_import)
            threads = int(torch.get_num_threads())
        total += dot_scratch(footprint, dtype, elements, threads)
    return math.ceil(total * MARGIN) + CALL_BYTES
