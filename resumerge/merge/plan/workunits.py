"""Memory estimates of the engine's units of work, and row chunks for tensors too large to hold at once.

An estimate counts what one output tensor keeps alive while it is computed: every input at its stored dtype,
the copies cast to the compute dtype, the method's measured working set, and the output buffer until the writer
has written it. Elementwise methods may process a tensor in row chunks (rows are contiguous on disk), so their
unit is one chunk; so may methods with a streamed form (``ties``, ``breadcrumbs``: a few passes over the chunks,
see :class:`~resumerge.merge.methods.spec.RowStream`); other methods need the whole tensor, and a tensor whose estimate
exceeds the budget is refused at plan time with the smallest budget that works. :func:`unit_mode` is the one rule
for how the engine computes each tensor, which ``plan``'s estimate follows too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import MappingProxyType

from resumerge.inputs.safetensors_format import numel
from resumerge.inputs.tensorio import NAME_DTYPES, TORCH_DTYPES
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import working_bytes
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.methods.spec import RowStream
from resumerge.merge.plan.merge_plan import Plan, TensorPlan
from resumerge.merge.plan.unitkey import TensorClasses

_COMPUTE_SIZES = MappingProxyType({"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8})


def estimate_bytes(tp: TensorPlan, method: MethodSpec, rows: int | None = None, *, threads: int | None = None) -> int:
    """Bytes kept alive while computing ``tp`` (or ``rows`` of its rows): the stored inputs (decoded too, when
    a codec decodes them: the size its decoded value has), a copy of each input
    that reaches the method in another dtype or re-indexed to the output vocabulary, the method's measured working
    set (its declared :attr:`~resumerge.merge.methods.spec.MethodSpec.footprint`, evaluated by
    :func:`~resumerge.merge.methods.footprint.working_bytes`: its result included, with a margin), the output
    buffer, and a LoRA delta's factors. ``threads`` is torch's thread count where the merge runs (None: this
    process's torch; see :func:`~resumerge.merge.methods.footprint.working_bytes`), as for every sizing function
    here."""
    if method.held_param is not None:  # a unit that reads its own row ranges says what it holds (whole, always)
        return int(dict(tp.params)[method.held_param])
    if tp.experts is not None and rows is None:
        # Merged an expert at a time (resumerge.merge.engine.experts): one expert's estimate, the whole result in the
        # dtype the method computes in, and its encoded output until the writer has it.
        whole = numel(tp.shape) * _COMPUTE_SIZES.get(_seen_dtype(tp), 8)
        return estimate_bytes(tp, method, rows=1, threads=threads) + whole + tp.nbytes
    shape, fraction = tp.shape, 1.0
    if rows is not None and tp.shape:
        shape, fraction = (rows, *tp.shape[1:]), rows / max(1, tp.shape[0])
    count = numel(shape)
    # One pass over the inputs (a 92k-tensor plan's estimate asks this three times a tensor): the dtype each is
    # seen in, and what each holds stored (and decoded, when a codec decodes it: a plain input's value is its
    # buffer).
    values, held, recast = [], [], 0
    for i in tp.inputs:
        value = i.value_dtype
        values.append(_SEEN.get(value, value))
        held.append(i.stored_bytes + i.decoded_bytes)
        recast += i.cast not in (None, i.dtype)
    seen = tp.compute_dtype if tp.compute_dtype is not None else _common_dtype(set(values))
    # `.to()` to a tensor's own dtype returns that tensor, and a local read is one buffer viewed in the stored
    # dtype (measured: no copy), so only an input whose dtype changes on its way to the method costs a copy; a
    # vocabulary-aligned input is gathered into a new tensor whatever its dtype.
    copies = len(values) if tp.vocab_aligned else recast + sum(
        1 for i, value in zip(tp.inputs, values) if i.cast in (None, i.dtype) and value != seen)
    cast = copies * count * _COMPUTE_SIZES.get(seen, 8)
    if method.footprint is None:  # register() refuses such a method; only a hand-made spec gets here
        raise ValueError(f"merge method {method.name!r} declares no footprint")
    # A decomposition's figures are per element of the matrix it factors (its largest input), not of its result.
    basis = max((i.shape for i in tp.inputs), key=numel) if method.footprint.of_inputs and tp.inputs else shape
    flat = method.footprint.flat_unless
    if flat and not dict(tp.params).get(flat, True):  # a matrix the method averages, as a vector
        basis = (numel(basis),)
    # A decomposition's result is its rank-r factor: r is its shorter side.
    rank = min(tp.shape) if method.footprint.of_inputs and tp.shape else None
    work = working_bytes(method.footprint, seen, basis, len(tp.inputs), base=tp.base_index is not None,
                         threads=threads, rank=rank)
    stored = sum(held)
    if method.lazy_inputs and len(tp.inputs) > 1 and rows is None:
        # Its largest input whole, the others a row chunk at a time (LoRA extraction's task vector).
        sizes = sorted(held)
        stored = sizes[-1] + sum(min(size, CHUNK_ELEMENTS * 8) for size in sizes[:-1])
    whole = numel(tp.shape)
    # A LoRA delta: the merged copy of the input, plus the whole factors and their float64 copies.
    lora = sum(whole * 4 + 3 * (i.lora.a.end - i.lora.a.start + i.lora.b.end - i.lora.b.start)
               for i in tp.inputs if i.lora is not None)
    return int((stored + tp.nbytes) * fraction) + cast + work + lora


# The dtype a method sees, by its inputs' safetensors dtype, when the config sets none.
_SEEN = MappingProxyType({"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"})


def _seen_dtype(tp: TensorPlan) -> str:
    """The dtype ``tp``'s method computes in: the config's ``dtype``, else the inputs' own (float32 when they
    differ and none is float64: torch promotes a float16 and a bfloat16 to float32)."""
    if tp.compute_dtype is not None:
        return tp.compute_dtype
    return _common_dtype({_SEEN.get(i.value_dtype, i.value_dtype) for i in tp.inputs})


def _common_dtype(names: set[str]) -> str:
    """The dtype inputs seen in ``names`` are computed in (see :func:`_seen_dtype`)."""
    if len(names) == 1:
        return next(iter(names))
    return "float64" if "float64" in names else "float32"


def can_chunk(tp: TensorPlan, method: MethodSpec) -> bool:
    """True when ``tp`` may be computed in row chunks (an elementwise method over a tensor with rows whose
    input rows are output rows — not a vocabulary-aligned tensor, whose rows are gathered and averaged, nor a table
    cut per layer along its rows, whose blocks are merged whole)."""
    return (method.elementwise and len(tp.shape) >= 1 and tp.shape[0] > 1 and not tp.vocab_aligned
            and (tp.blocks is None or tp.blocks.axis != 0))


def row_stream(tp: TensorPlan, method: MethodSpec, device: str) -> RowStream | None:
    """A fresh :class:`~resumerge.merge.methods.spec.RowStream` computing ``tp`` from row chunks, or None: the method
    has no streamed form or refuses these parameters (say ``rescale``), the tensor has no rows to cut, its rows are
    gathered (vocabulary-aligned), or the merge runs on a GPU (streams run on the CPU only)."""
    if (method.streamed is None or device != "cpu" or not tp.shape or tp.shape[0] < 2 or tp.vocab_aligned
            or tp.experts is not None or tp.blocks is not None):  # it ranks all its rows, not an expert's or block's
        return None
    # The dtype's name: sizing a run's streams must not import torch (resumerge.machine.torch_import).
    return method.streamed(tuple(tp.shape), tp.base_index, [dict(p) for p in tp.model_params], dict(tp.params),
                           dtype=_seen_dtype(tp))


def method_dtype(tp: TensorPlan) -> torch.dtype:
    """The dtype the method sees ``tp``'s inputs in: the config's ``dtype``, else their common (promoted) one."""
    if tp.compute_dtype is not None:
        return NAME_DTYPES[tp.compute_dtype]
    common = TORCH_DTYPES[tp.inputs[0].value_dtype]
    for ref in tp.inputs[1:]:
        common = torch.promote_types(common, TORCH_DTYPES[ref.value_dtype])
    return common


def held_bytes(tp: TensorPlan, method: MethodSpec) -> int:
    """What ``tp``'s stream keeps from its first chunk to its last (its sampled masks, say): reserved for the whole
    of a streamed tensor's passes, on top of its chunks. 0 when it has no stream."""
    stream = row_stream(tp, method, "cpu")
    return stream.held_bytes() if stream is not None else 0


# How the engine computes one tensor (see unit_mode).
WHOLE, ROWS, PASSES = "whole", "rows", "passes"

# Entries per row chunk of a streamed (multi-pass) tensor, per input and over its stacked task vectors. A chunk's
# buffers stay at or under the 1 MiB mmap threshold :func:`~resumerge.machine.memory.allocator.tune_allocator` sets (128
# Ki float32 entries are 512 KiB), so they reuse heap memory that glibc keeps instead of faulting fresh pages in; and a
# chunk is large enough that the Python between its kernels, which holds the GIL, costs the engine's other worker
# little. Measured on the 1.75 GB float32 bench (breadcrumbs, two workers, 2 cores): 24.5 / 18.6 / 15.3 / 18.8 /
# 21.6 s for chunks of 32 / 64 / 128 / 256 / 512 Ki entries, against 15.7-16.1 s holding every tensor whole.
CHUNK_ELEMENTS = 1 << 17
STACKED_ELEMENTS = 1 << 18
# The most one row chunk of a tensor streamed to the writer holds (its estimate), however much room the budget
# leaves: the chunks of DeepSeek-V3's 1.85 GB embedding once grew to the whole room (its whole estimate is 14.8 GB),
# so a notebook's peak grew with the machine; chunks of this size cost no measurable speed.
ROW_CHUNK_BYTES = 512 << 20
# The least one row chunk holds (its estimate), however little room is left: a budget too tight for such a chunk
# once cut a 37 MB embedding into 16,000 one-row chunks, each admitted alone over the headroom after a garbage
# collection (4,096 adaptations, 135 s instead of 4.4 s). The smallest budget leaves room for one (issue 71).
MIN_CHUNK_BYTES = 4 << 20


def unit_mode(tp: TensorPlan, method: MethodSpec, budget: int | None, device: str, *, rereadable: bool = True,
              serial: bool = True, threads: int | None = None) -> str:
    """How the engine computes ``tp`` under ``budget`` (None: no memory governor).

    A stream that prefers the whole tensor (:attr:`~resumerge.merge.methods.spec.RowStream.prefer_whole`) is used only
    when the whole tensor's estimate exceeds a quarter of the budget.

    ``PASSES``: a streamed method's tensor of more than one chunk (:func:`pass_rows`), computed chunk by chunk into
    its whole output and admitted like any unit, when that unit (a chunk and the output) takes at most a quarter of
    the budget, its inputs are ``rereadable`` at local cost (each pass reads them again) and ``serial`` kernels
    cost no cores (the engine's workers are at least torch's threads: chunk kernels run serially, see
    :mod:`resumerge.inputs.kernels`). ``ROWS``: otherwise, a tensor an elementwise or streamed method can cut into
    rows whose whole estimate exceeds a quarter of the budget streams row chunks to the writer one at a time,
    nothing else in flight, and so does a tensor its method always streams (:func:`fixed_chunk_rows`).
    Otherwise ``WHOLE``.
    """
    quarter = None if budget is None else budget // 4
    stream = row_stream(tp, method, device)
    streams = stream is not None
    if stream is not None and stream.prefer_whole and (
            quarter is None or estimate_bytes(tp, method, threads=threads) <= quarter):
        return WHOLE  # streaming it would be slower, and it fits whole
    passes = streams and rereadable and serial and tp.shape[0] > pass_rows(tp)
    if passes and (quarter is None or unit_bytes(tp, method, PASSES, threads=threads) <= quarter):
        return PASSES
    if (quarter is not None and (can_chunk(tp, method) or streams)
            and estimate_bytes(tp, method, threads=threads) > quarter):
        return ROWS
    if quarter is not None and fixed_chunk_rows(tp, method) is not None:
        return ROWS
    return WHOLE


def collects_sibling(previous: TensorPlan | None, tp: TensorPlan, method: MethodSpec) -> bool:
    """Whether ``tp``'s unit only collects what ``previous``'s computed (a LoRA module's B after its A: one
    computation serves :attr:`~resumerge.merge.methods.spec.WholeCost.shared_by` consecutive tensors). Such a unit
    waits, computing nothing, so the engine does not count it among its working units."""
    return (method.whole_cost is not None and method.whole_cost.shared_by > 1 and previous is not None
            and previous.params == tp.params and previous.inputs == tp.inputs)


def fixed_chunk_rows(tp: TensorPlan, method: MethodSpec) -> int | None:
    """Rows per chunk of a tensor its method always streams in chunks of at most
    :attr:`~resumerge.merge.methods.spec.MethodSpec.row_chunk` entries; None when it is not cut that way (no such
    method, rows that cannot be cut, or a tensor no larger than one chunk)."""
    if method.row_chunk is None or not can_chunk(tp, method) or numel(tp.shape) <= method.row_chunk:
        return None
    return max(1, method.row_chunk // max(1, numel(tp.shape[1:])))


def stream_rows(tp: TensorPlan, method: MethodSpec, *, threads: int | None = None) -> int:
    """The most rows per chunk of a tensor streamed to the writer in row chunks (``ROWS``): its method's fixed
    chunk (:func:`fixed_chunk_rows`), else as many rows as :data:`ROW_CHUNK_BYTES` of estimate holds (at least
    one; every row when they all fit). The engine cuts smaller chunks when the headroom is smaller."""
    fixed = fixed_chunk_rows(tp, method)
    if fixed is not None:
        return fixed
    return max(1, min(tp.shape[0], ROW_CHUNK_BYTES // max(1, estimate_bytes(tp, method, rows=1, threads=threads))))


def streamed_bytes(tp: TensorPlan, method: MethodSpec, *, threads: int | None = None) -> int:
    """What a tensor streamed to the writer in row chunks holds at most: one chunk computed, one queued and one
    being written (:func:`stream_rows` rows each), or the whole tensor's estimate when that is less."""
    rows = stream_rows(tp, method, threads=threads)
    return min(estimate_bytes(tp, method, threads=threads), 3 * estimate_bytes(tp, method, rows, threads=threads))


def pass_rows(tp: TensorPlan) -> int:
    """Rows per chunk of a streamed tensor: at most :data:`CHUNK_ELEMENTS` entries per input and
    :data:`STACKED_ELEMENTS` over the inputs other than the base, at least one row (at least one
    :func:`row_step`, and a multiple of it)."""
    row = max(1, numel(tp.shape[1:]))
    entries = min(CHUNK_ELEMENTS, STACKED_ELEMENTS // max(1, len(tp.inputs) - 1))
    return aligned_rows(tp, max(1, entries // row), tp.shape[0])


def row_step(tp: TensorPlan) -> int:
    """The rows every row chunk of ``tp`` but its last is a multiple of: the block height of the format it is
    written in (a stored copy's input is in that same format: see :mod:`resumerge.merge.plan.copies`; see
    :attr:`~resumerge.inputs.codecs.TensorEncoder.row_block`), and every input's
    :attr:`~resumerge.inputs.codecs.TensorDecoder.read_block`."""
    step = tp.out_codec.row_block
    for ref in tp.inputs:  # an input decoded in groups of rows (interleaved heads) is read in whole groups
        step = math.lcm(step, ref.codec.read_block)
    return step


def aligned_rows(tp: TensorPlan, rows: int, left: int) -> int:
    """A chunk of about ``rows`` of the ``left`` rows still to do of ``tp``: all of them when ``rows`` reaches
    them, else ``rows`` rounded down to a multiple of :func:`row_step` (at least one step)."""
    if rows >= left:
        return left
    step = row_step(tp)
    return min(left, max(step, rows - rows % step))


def unit_bytes(tp: TensorPlan, method: MethodSpec, mode: str, *, threads: int | None = None) -> int:
    """What the admission of ``tp`` as one unit reserves: a chunk's estimate, the assembled output and what its
    stream holds across passes (:func:`held_bytes`) for ``PASSES``, else the whole estimate (``ROWS`` tensors are
    admitted chunk by chunk instead)."""
    if mode == PASSES:
        return estimate_bytes(tp, method, rows=pass_rows(tp), threads=threads) + tp.nbytes + held_bytes(tp, method)
    return estimate_bytes(tp, method, threads=threads)


def chunk_plan(tp: TensorPlan, first: int, stop: int) -> TensorPlan:
    """``tp`` restricted to rows ``[first, stop)`` (same name, parameters and dtypes; its encoder the chunk's:
    :meth:`~resumerge.inputs.codecs.TensorEncoder.from_row`)."""
    shape = (stop - first, *tp.shape[1:])
    return replace(tp, inputs=tuple(i.rows(first, stop) for i in tp.inputs), shape=shape,
                   out_codec=tp.out_codec.from_row(first)).sized()


@dataclass(frozen=True)
class Oversized:
    """A whole-tensor unit that cannot fit the budget: the tensor and the budget it would need."""

    tensor: str
    method: str
    needed: int


def floor_rows(tp: TensorPlan, method: MethodSpec, *, threads: int | None = None) -> int:
    """The fewest rows per chunk the engine cuts a tensor into, however little room the budget leaves: as many as
    :data:`MIN_CHUNK_BYTES` of estimate holds (every row when the whole tensor holds less), aligned
    (:func:`aligned_rows`). The smallest budget leaves room for such a chunk (:func:`smallest_budget`)."""
    row = max(1, estimate_bytes(tp, method, rows=1, threads=threads))
    return aligned_rows(tp, max(1, -(-MIN_CHUNK_BYTES // row)), tp.shape[0])


def step_bytes(tp: TensorPlan, method: MethodSpec, device: str, *, threads: int | None = None) -> int:
    """The most one step of ``tp`` holds under the smallest budget: its whole estimate, or for a tensor that can be
    cut into rows a chunk of :func:`floor_rows` rows (with what its stream keeps across chunks)."""
    stream = row_stream(tp, method, device)
    chunkable = can_chunk(tp, method) or stream is not None
    unit = estimate_bytes(tp, method, rows=floor_rows(tp, method, threads=threads) if chunkable else None,
                          threads=threads)
    if stream is not None and not can_chunk(tp, method):
        unit += stream.held_bytes()
    return unit


def oversized_units(plan: Plan, budget: int, baseline: int, device: str | None = None,
                    classes: TensorClasses | None = None, *, threads: int | None = None) -> list[Oversized]:
    """Tensors that no amount of waiting can fit under ``budget`` (given ``baseline`` bytes already in use) on
    ``device`` (default the plan's): a tensor that can be cut into rows needs room for one chunk of
    :func:`floor_rows` rows (:func:`step_bytes`). Each class of the plan's tensors is sized once (``classes``, when
    the caller sorted them already: a 92k-tensor plan holds a few dozen classes)."""
    from resumerge.machine.memory import smallest_budget_for

    where = device or plan.options.device

    def needed(tp: TensorPlan) -> int:
        return smallest_budget_for(step_bytes(tp, plan.method_of(tp), where, threads=threads),
                                   baseline_bytes=baseline)

    classes = classes if classes is not None else TensorClasses(plan.tensors.values())
    need = [needed(tp) for tp in classes.members]
    if all(n <= budget for n in need):
        return []
    return [Oversized(tp.name, tp.method, n) for tp in plan.tensors.values() for n in [need[classes.number(tp)]]
            if n > budget]


def smallest_budget(plan: Plan, baseline: int, device: str | None = None, classes: TensorClasses | None = None,
                    *, threads: int | None = None) -> Oversized | None:
    """The smallest budget ``plan``'s merge works under beside ``baseline`` bytes (the process's own, see
    :func:`resumerge.merge.engine.footprint.run_baseline`), with the tensor whose step needs it; None for a plan without
    tensors. The one figure ``plan``, ``run`` and their refusals name (:func:`oversized_units` with no budget)."""
    from resumerge.machine.memory import smallest_budget_for

    where = device or plan.options.device
    classes = classes if classes is not None else TensorClasses(plan.tensors.values())
    sized = [(smallest_budget_for(step_bytes(tp, plan.method_of(tp), where, threads=threads), baseline_bytes=baseline),
              tp) for tp in classes.members]
    if not sized:
        return None
    needed, worst = max(sized, key=lambda pair: pair[0])
    return Oversized(worst.name, worst.method, needed)


def largest(units: Iterable[Oversized]) -> Oversized:
    """The unit needing the most memory."""
    return max(units, key=lambda u: u.needed)
