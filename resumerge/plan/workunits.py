"""Memory estimates of the engine's units of work, and row chunks for tensors too large to hold at once.

An estimate counts what one output tensor keeps alive while it is computed: every input at its stored dtype,
the copies cast to the compute dtype, the method's measured working set, and the output buffer until the writer
has written it. Elementwise methods may process a tensor in row chunks (rows are contiguous on disk), so their
unit is one chunk; other methods need the whole tensor, and a tensor whose estimate exceeds the budget is
refused at plan time with the smallest budget that works.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterable
from dataclasses import dataclass, replace

from resumerge.inputs.safetensors_format import DTYPE_SIZES, numel
from resumerge.methods.footprint import working_bytes
from resumerge.methods.registry import MethodSpec, get_method
from resumerge.plan.merge_plan import InputRef, Plan, TensorPlan

_COMPUTE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}


def estimate_bytes(tp: TensorPlan, method: MethodSpec, rows: int | None = None) -> int:
    """Bytes kept alive while computing ``tp`` (or ``rows`` of its rows): the stored inputs, a copy of each input
    that reaches the method in another dtype or re-indexed to the output vocabulary, the method's measured working
    set (:func:`~resumerge.methods.footprint.working_bytes`: its result included, with a margin), the output
    buffer, and a LoRA delta's factors."""
    shape, fraction = tp.shape, 1.0
    if rows is not None and tp.shape:
        shape, fraction = (rows, *tp.shape[1:]), rows / max(1, tp.shape[0])
    count = numel(shape)
    seen = _seen_dtype(tp)
    # `.to()` to a tensor's own dtype returns that tensor, and a local read is one buffer viewed in the stored
    # dtype (measured: no copy), so only an input whose dtype changes on its way to the method costs a copy; a
    # vocabulary-aligned input is gathered into a new tensor whatever its dtype.
    copies = sum(1 for i in tp.inputs if tp.vocab_aligned or i.cast not in (None, i.dtype)
                 or _SEEN.get(i.value_dtype, i.value_dtype) != seen)
    cast = copies * count * _COMPUTE_SIZES.get(seen, 8)
    work = working_bytes(method.name, seen, shape, len(tp.inputs), base=tp.base_index is not None)
    stored = sum(i.end - i.start for i in tp.inputs)
    whole = numel(tp.shape)
    # A LoRA delta: the merged copy of the input, plus the whole factors and their float64 copies.
    lora = sum(whole * 4 + 3 * (i.lora.a.end - i.lora.a.start + i.lora.b.end - i.lora.b.start)
               for i in tp.inputs if i.lora is not None)
    return int((stored + tp.nbytes) * fraction) + cast + work + lora


# The dtype a method sees, by its inputs' safetensors dtype, when the config sets none.
_SEEN = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _seen_dtype(tp: TensorPlan) -> str:
    """The dtype ``tp``'s method computes in: the config's ``dtype``, else the inputs' own (float32 when they
    differ and none is float64: torch promotes a float16 and a bfloat16 to float32)."""
    if tp.compute_dtype is not None:
        return tp.compute_dtype
    names = {_SEEN.get(i.value_dtype, i.value_dtype) for i in tp.inputs}
    if len(names) == 1:
        return names.pop()
    return "float64" if "float64" in names else "float32"


def can_chunk(tp: TensorPlan, method: MethodSpec) -> bool:
    """True when ``tp`` may be computed in row chunks (an elementwise method over a tensor with rows whose
    input rows are output rows — not a vocabulary-aligned tensor, whose rows are gathered and averaged)."""
    return method.elementwise and len(tp.shape) >= 1 and tp.shape[0] > 1 and not tp.vocab_aligned


def row_slice(ref: InputRef, first: int, stop: int) -> InputRef:
    """The part of ``ref`` holding rows ``[first, stop)`` (row-major storage keeps them contiguous)."""
    row_bytes = (ref.end - ref.start) // ref.shape[0]
    return replace(ref, shape=(stop - first, *ref.shape[1:]), start=ref.start + first * row_bytes,
                   end=ref.start + stop * row_bytes, first_row=ref.first_row + first)


def chunk_plan(tp: TensorPlan, first: int, stop: int) -> TensorPlan:
    """``tp`` restricted to rows ``[first, stop)`` (same name, parameters and dtypes)."""
    shape = (stop - first, *tp.shape[1:])
    return replace(tp, inputs=tuple(row_slice(i, first, stop) for i in tp.inputs), shape=shape,
                   nbytes=numel(shape) * DTYPE_SIZES[tp.out_dtype])


@dataclass(frozen=True)
class Oversized:
    """A whole-tensor unit that cannot fit the budget: the tensor and the budget it would need."""

    tensor: str
    method: str
    needed: int


def oversized_units(plan: Plan, budget: int, baseline: int) -> list[Oversized]:
    """Tensors that no amount of waiting can fit under ``budget`` (given ``baseline`` bytes already in use)."""
    from resumerge.memory import smallest_budget_for

    found = []
    for tp in plan.tensors.values():
        method = get_method(tp.method)
        assert method is not None
        unit = estimate_bytes(tp, method, rows=1 if can_chunk(tp, method) else None)
        need = smallest_budget_for(unit, baseline_bytes=baseline)
        if need > budget:
            found.append(Oversized(tp.name, tp.method, need))
    return found


def largest(units: Iterable[Oversized]) -> Oversized:
    """The unit needing the most memory."""
    return max(units, key=lambda u: u.needed)


def tune_allocator() -> None:
    """Make glibc return large freed buffers to the OS at once (best effort; no-op elsewhere).

    glibc raises its mmap threshold after each large free, so later tensor-sized buffers come from the heap and
    stay in RSS after they are freed. Pinning the threshold at 1 MiB keeps RSS following the tensors in flight.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, 1 << 20)
