"""The weight files a plan would write, read without being written: each stored tensor computed by the plan's own
method code when its bytes are asked for, and dropped once handed over.

:class:`MergedFiles` is an :class:`~resumerge.inputs.source.InputSource` (the seam every reader of a model's bytes
goes through) over the files of :meth:`~resumerge.merge.plan.merge_plan.Plan.shard_layout`: a read of the byte range
where the plan puts a stored tensor returns what ``run`` would have written there, so a reader of those files (the
forward pass's :class:`~resumerge.forward.engine.reader.CastReader`, a recipe's next stage) reads the merge exactly as
it would read it stored. An output tensor stored as several parts (a quantized output's codes and scales) is
computed once: the parts not asked for yet wait for their read, until another tensor is computed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from resumerge.errors import ResumergeError
from resumerge.inputs.source import InputSource, InputSources
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.machine.memory import MemoryGovernor
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.compute import SharedInputs, Stored
from resumerge.merge.engine.groupscales import GroupScales
from resumerge.merge.engine.unwritten.compute import merged_rows, merged_tensor
from resumerge.merge.methods.resources import NO_RESOURCES, Resources
from resumerge.merge.plan.merge_plan import Plan, TensorPlan

# Where a stored part lies in the planned files: (file, start) -> (output tensor, part name, end).
Places = dict[tuple[str, int], tuple[str, str, int]]


def stored_places(plan: Plan) -> Places:
    """Where each stored part of ``plan``'s output lies in its files (as :func:`~resumerge.merge.plan.outmodel.
    planned_model` places them)."""
    places: Places = {}
    for shard in plan.shards:
        layout = plan.shard_layout(shard)
        base = len(layout.header)
        owner = {p: name for name, parts in plan.shard_parts(shard).items() for p in parts}
        for part in layout.order:
            start = base + part.offset
            places[(shard.name, start)] = (owner[part.name], part.name, start + part.nbytes)
    return places


# Computes one output tensor's stored parts (``merged_tensor`` over the plan's inputs, by default).
Compute = Callable[[TensorPlan], Stored]
# Computes some rows of one output tensor (``merged_rows``), or None where they are not merged alone.
Rows = Callable[[TensorPlan, "torch.Tensor"], "torch.Tensor | None"]  # quoted: torch is imported on first use


class MergedFiles(InputSource):
    """The files ``plan`` would write, each stored tensor computed from ``sources`` (the plan's inputs, by model key)
    when read (see the module docstring); ``resources``: what the plan's units share (MoE upcycling's); ``governor``:
    each computation admitted by it as the run admits it; ``shared``: see :func:`merged_tensor`. ``sources`` stay the
    caller's to close. Thread-safe: one tensor computed at a time."""

    def __init__(self, plan: Plan, sources: InputSources, resources: Resources = NO_RESOURCES, *,
                 governor: MemoryGovernor | None = None, compute: Compute | None = None,
                 shared: SharedInputs | None = None) -> None:
        self.plan = plan
        self._places = stored_places(plan)
        scales = GroupScales(plan)  # each fused group measured once, as the run measures it
        self._compute: Compute = compute if compute is not None else (
            lambda tp: merged_tensor(plan, tp, sources, resources, governor=governor, shared=shared, scales=scales))
        # Some rows of a tensor, merged alone (None: where ``compute`` is given, every read is of a whole tensor).
        self._rows: Rows | None = None if compute is not None else (
            lambda tp, rows: merged_rows(plan, tp, sources, resources, rows, governor=governor, shared=shared))
        self._waiting: Stored = {}  # the parts of the last tensor computed not read yet
        self._lock = threading.Lock()
        self.computed = 0  # output tensors computed so far (a part read again is computed again)

    def read_tensor(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The stored tensor at ``[start, end)`` of planned ``file``, as ``run`` writes it (a range inside one,
        its bytes)."""
        with self._lock:
            place = self._places.get((file, start))
            if place is not None and place[2] == end:
                part = self._part(place[0], place[1])
                if TORCH_DTYPES[dtype] == part.dtype and part.numel() == _count(shape):
                    return part.reshape(shape)
                return part.reshape(-1).view(torch.uint8).view(TORCH_DTYPES[dtype]).reshape(shape)
        return self.read_range(file, start, end).view(TORCH_DTYPES[dtype]).reshape(shape)

    def read_rows(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
                  rows: torch.Tensor) -> torch.Tensor | None:
        """Rows ``rows`` of the stored tensor at ``[start, end)`` of planned ``file``, merged for those rows alone
        where its method makes that exact (:func:`~resumerge.merge.engine.unwritten.compute.merged_rows`: the same bits
        as those rows of the whole); None elsewhere (a read of the whole tensor merges it whole)."""
        with self._lock:
            place = self._places.get((file, start))
            if self._rows is None or place is None or place[2] != end or place[0] != place[1]:
                return None  # not one output tensor's only part
            found = self._rows(self.plan.tensors[place[0]], rows)
            if found is None or TORCH_DTYPES[dtype] != found.dtype or found.shape != (len(rows), *shape[1:]):
                return None
            return found

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of planned ``file``: those of the stored part they lie in (a range across parts,
        or outside every part, is refused: no reader of a model asks for one)."""
        with self._lock:
            inside = [(s, p) for (f, s), p in self._places.items() if f == file and s <= start and end <= p[2]]
            if not inside:
                raise ResumergeError(f"internal: bytes {start}-{end} of {file} are not one stored tensor of the "
                                     "merge", path=file)
            first, (name, part_name, _) = inside[0]
            part = self._part(name, part_name)
            return part.reshape(-1).view(torch.uint8)[start - first:end - first].clone()

    def _part(self, name: str, part: str) -> torch.Tensor:
        """Stored part ``part`` of output tensor ``name``: waiting since its tensor was computed, else computed
        now (its other parts then wait instead of the last tensor's)."""
        found = self._waiting.pop(part, None)
        if found is not None:
            return found
        stored = self._compute(self.plan.tensors[name])
        self.computed += 1
        found = stored.pop(part)
        self._waiting = stored
        return found

    def close(self) -> None:
        """Drop what waits to be read."""
        with self._lock:
            self._waiting = {}


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
