"""A generation of candidate merges over the same inputs, read in one streamed pass: per decoder layer each input's
tensor is read once, and every candidate's tensors of that layer are merged from it in memory.

A :class:`Population` is one :class:`~resumerge.merge.engine.unwritten.model.UnwrittenMerge` per candidate plan, all
reading their inputs through one :class:`SharedReads`: inside :meth:`Population.layer`, the first read of a byte
range of an input is read from the input and kept, and every later read of it (another candidate's merge of the same
tensor) is a copy of what was kept; leaving the block drops what was kept. A pass over the layers that runs every
candidate's layer inside the block of that layer reads each input's layer once, whatever the number of candidates,
and holds the inputs' layer plus the one candidate's layer that runs (its tensors merged, read by the forward engine
and dropped as a stored model's are). Each candidate's tensor is merged by the same code as its single source's
(:func:`~resumerge.merge.engine.unwritten.compute.merged_tensor`), from the same bytes: the same bytes as ``run``
writes.

What depends on the inputs alone is computed once for every candidate inside the block (:class:`LayerInputs`): each
chunk's inputs as loaded (read and cast to the compute dtype), and the values its method declares from them
(:attr:`~resumerge.merge.methods.spec.MethodSpec.from_inputs`: the task vectors of the task-arithmetic family, the
magnitude keys its rank windows order them by), computed by the method's own function, so that each candidate's
bytes are those it has merged alone; they are dropped with the block.

:func:`generation_bytes` says what such a pass holds for ``popsize`` candidates, so that a search refuses up front a
generation its budget cannot hold, and :func:`largest_popsize` names the largest that fits.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from resumerge.config.closing import Closing
from resumerge.errors import UsageError
from resumerge.inputs.safetensors_format import numel
from resumerge.inputs.source import InputSources
from resumerge.machine.memory import MemoryGovernor
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.unwritten.model import UnwrittenMerge
from resumerge.merge.methods.resources import NO_RESOURCES, Resources
from resumerge.merge.methods.spec import InputsOnly
from resumerge.merge.plan.architecture import split_layer_name
from resumerge.merge.plan.merge_plan import InputRef, Plan, TensorPlan
from resumerge.merge.plan.workunits import estimate_bytes, method_dtype

# A read as the engine asks for it: (model, file, start, end, dtype, shape).
ReadKey = tuple[str, str, int, int, str, tuple[int, ...]]


class SharedReads(InputSources):
    """``inputs`` (the caller's to close) read through a store of what was read: inside :meth:`sharing`, a byte
    range read again is a copy of the first read of it, all of them dropped when the block ends; outside, every read
    goes to ``inputs``. :attr:`reads` and :attr:`bytes_read` count what was read from ``inputs``, :attr:`peak_kept`
    is the most bytes kept at once."""

    def __init__(self, inputs: InputSources) -> None:
        super().__init__({})
        self._inputs = inputs
        self._kept: dict[ReadKey, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0
        self._kept_bytes = 0
        self.peak_kept = 0

    @contextmanager
    def sharing(self) -> Iterator[None]:
        """Reads inside the block are read once and kept until it ends."""
        with self._lock:
            self._kept, self._kept_bytes = {}, 0
        try:
            yield
        finally:
            with self._lock:
                self._kept, self._kept_bytes = None, 0

    def read(self, model: str, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...],
             into: torch.Tensor | None = None) -> torch.Tensor:
        key = (model, file, start, end, dtype, tuple(shape))
        with self._lock:
            kept = self._kept
            found = kept.get(key) if kept is not None else None
            if found is None:
                found = self._inputs.read(model, file, start, end, dtype, shape)
                self.reads += 1
                self.bytes_read += end - start
                if kept is None:
                    return found
                kept[key] = found
                self._kept_bytes += end - start
                self.peak_kept = max(self.peak_kept, self._kept_bytes)
        # A copy (never into ``into``: a fresh tensor is what a source that cannot read into memory returns): a
        # method that owns its inputs may change them in place (resumerge.merge.methods.spec.MergeContext).
        return found.clone()

    def rereads_cheaply(self, model: str, file: str) -> bool:
        return self._inputs.rereads_cheaply(model, file)

    def expect(self, order: Sequence[tuple[str, str, int, int]]) -> None:
        self._inputs.expect(order)

    def checked(self, model: str, file: str, timeout: float) -> bool:
        return self._inputs.checked(model, file, timeout)

    def stop(self) -> None:
        self._inputs.stop()

    def close(self) -> None:
        """Drop what is kept (``inputs`` stay open)."""
        with self._lock:
            if self._kept is not None:
                self._kept.clear()
                self._kept_bytes = 0


class LayerInputs:
    """The :class:`~resumerge.merge.engine.compute.SharedInputs` of a generation's candidates: inside :meth:`sharing`,
    each chunk's loaded inputs and its method's declared values are computed once and kept until the block ends;
    outside, nothing is kept (each merge computes its own). :attr:`computed` counts the values computed inside a
    block, by what they are (``inputs``, or the declared value's name), :attr:`reused` those handed again;
    :attr:`peak_kept` is the most bytes kept at once."""

    def __init__(self) -> None:
        # False: nothing is kept even inside a block (a budget that cannot hold what sharing keeps).
        self.enabled = True
        self._kept: dict[Hashable, object] | None = None
        self._lock = threading.RLock()
        self._kept_bytes = 0
        self.peak_kept = 0
        self.computed: Counter[str] = Counter()
        self.reused: Counter[str] = Counter()

    @contextmanager
    def sharing(self) -> Iterator[None]:
        """Values computed inside the block are kept for every merge until it ends."""
        with self._lock:
            self._kept, self._kept_bytes = ({} if self.enabled else None), 0
        try:
            yield
        finally:
            with self._lock:
                self._kept, self._kept_bytes = None, 0

    def loaded(self, key: Hashable, load: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        found = self._get(("inputs", key), lambda: tuple(load()))
        assert isinstance(found, tuple)
        return found

    def memo(self, key: Hashable, declared: tuple[InputsOnly, ...]) -> _ChunkMemo:
        return _ChunkMemo(self, key, declared)

    def _get(self, key: Hashable, compute: Callable[[], object]) -> object:
        with self._lock:  # one merge at a time computes a chunk's values (a pass merges one candidate at a time)
            kept = self._kept
            what = str(key[0]) if isinstance(key, tuple) else str(key)
            if kept is not None and key in kept:
                self.reused[what] += 1
                return kept[key]
            found = compute()
            if kept is not None:
                self.computed[what] += 1
                kept[key] = found
                held = found if isinstance(found, tuple) else (found,)
                self._kept_bytes += sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
                self.peak_kept = max(self.peak_kept, self._kept_bytes)
            return found


class _ChunkMemo:
    """One chunk's :class:`~resumerge.merge.methods.spec.InputsMemo` in a :class:`LayerInputs`: only the values its
    method declares."""

    def __init__(self, layer: LayerInputs, key: Hashable, declared: tuple[InputsOnly, ...]) -> None:
        self._layer, self._key, self._declared = layer, key, declared

    def value(self, what: InputsOnly, index: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if what not in self._declared:
            raise ValueError(f"internal: {what.name} is not declared by the method as a value of its inputs alone")
        found = self._layer._get((what.name, index, self._key), compute)
        assert isinstance(found, torch.Tensor)
        return found


class Population(Closing):
    """The candidate merges ``plans`` (over the same input models, each in the same folder) as one generation: their
    :attr:`candidates` (an :class:`UnwrittenMerge` each, in order, named ``candidate N``) read their inputs through
    one :attr:`shared` store (see the module docstring). ``root``: where their folder of small files is made (one,
    where their config.json and tokenizer are the same); ``inputs``: the models' sources by key (the caller's to
    close; default: their folders, closed with the population); ``resources`` and ``governor`` as for
    :class:`~resumerge.merge.engine.unwritten.merged.MergedFiles`. Raises UsageError for plans over different inputs."""

    def __init__(self, plans: Sequence[Plan], root: Path, *, inputs: InputSources | None = None,
                 resources: Resources = NO_RESOURCES, governor: MemoryGovernor | None = None) -> None:
        if not plans:
            raise UsageError("a generation needs at least one candidate")
        same_inputs(plans)
        self.plans = tuple(plans)
        self._owned = inputs is None
        self._inputs = inputs if inputs is not None else InputSources.local(plans[0].model_dirs)
        self.shared = SharedReads(self._inputs)
        self.loaded = LayerInputs()
        self.candidates = tuple(UnwrittenMerge(plan, root, inputs=self.shared, resources=resources,
                                               governor=governor, name=f"candidate {i}", shared=self.loaded)
                                for i, plan in enumerate(plans))

    @contextmanager
    def layer(self) -> Iterator[None]:
        """The block in which the candidates' tensors of one layer (or of the parts outside the decoder layers) are
        read: each input byte range read once, and what depends on the inputs alone computed once, dropped when it
        ends."""
        with self.shared.sharing(), self.loaded.sharing():
            yield

    def holds(self, popsize: int | None = None, hidden_bytes: int = 0, value_bytes: int = 4, *,
              shared: bool | None = None) -> int:
        """:func:`generation_bytes` of these candidates' plans for ``popsize`` candidates (default: as many as
        there are), as their pass holds them: with what :attr:`loaded` keeps for all of them where it is enabled
        (``shared`` given: as it says)."""
        return generation_bytes(self.plans, len(self.plans) if popsize is None else popsize, hidden_bytes,
                                value_bytes, shared=self.loaded.enabled if shared is None else shared)

    def largest_popsize(self, budget: int, hidden_bytes: int, value_bytes: int = 4, *,
                        shared: bool | None = None) -> int:
        """:func:`largest_popsize` of these candidates' plans under ``budget``, judged as :meth:`holds` is."""
        return largest_popsize(self.plans, budget, hidden_bytes, value_bytes,
                               shared=self.loaded.enabled if shared is None else shared)

    def close(self) -> None:
        for candidate in self.candidates:
            candidate.close()
        self.shared.close()
        if self._owned:
            self._inputs.close()
            self._owned = False


def same_inputs(plans: Sequence[Plan]) -> None:
    """Refuse (UsageError) candidate plans whose input models differ (by key, or by folder)."""
    first = dict(plans[0].model_dirs)
    for i, plan in enumerate(plans[1:], start=1):
        if dict(plan.model_dirs) != first:
            other = sorted(set(plan.model_dirs) ^ set(first)) or sorted(
                k for k in first if plan.model_dirs[k] != first[k])
            raise UsageError(f"candidate {i} reads other models than candidate 0 ({other[0]}): a generation merges "
                             "the same models", hint="give every candidate the same models, with other parameters")


def layer_of(name: str) -> int | None:
    """The decoder layer output tensor ``name`` belongs to (None: outside the decoder layers)."""
    found = split_layer_name(name)
    return found[1] if found is not None else None


def generation_bytes(plans: Sequence[Plan], popsize: int, hidden_bytes: int = 0, value_bytes: int = 4, *,
                     shared: bool = False) -> int:
    """What one streamed pass of a generation of ``popsize`` candidates like ``plans`` (candidates over the same
    inputs: any of them, the largest figure taken) holds at most beyond the process's baseline: of the layer (or
    the parts outside the layers) that holds most, every input byte range its tensors read (kept for every
    candidate), one candidate's tensors of it at ``value_bytes`` a value (what the forward pass runs: 4 for
    float32), the largest merge of one of its tensors (its method's working set) and, ``shared``, what
    :class:`LayerInputs` keeps of it for every candidate; plus ``hidden_bytes`` for each candidate (its hidden
    states, held between layers). Without ``shared``: the least a pass of them holds (its sharing disabled)."""
    if popsize < 1:
        raise UsageError("a generation needs at least one candidate")
    groups: dict[int | None, list[tuple[Plan, TensorPlan]]] = {}
    for plan in plans:
        for tp in plan.tensors.values():
            groups.setdefault(layer_of(tp.name), []).append((plan, tp))
    most = 0
    for members in groups.values():
        reads: dict[tuple[str, str, int, int], int] = {}
        values: dict[int, int] = {}
        working = 0
        kept: dict[tuple[object, ...], int] = {}
        for plan, tp in members:
            for ref in _reads(tp):
                reads[(ref.model, ref.file, ref.start, ref.end)] = ref.end - ref.start
            values[id(plan)] = values.get(id(plan), 0) + numel(tp.shape) * value_bytes
            working = max(working, estimate_bytes(tp, plan.method_of(tp)))
            if shared:
                kept[(tp.name, tp.inputs)] = max(kept.get((tp.name, tp.inputs), 0), _kept_for_all(plan, tp))
        most = max(most, sum(reads.values()) + max(values.values()) + working + sum(kept.values()))
    return most + popsize * hidden_bytes


def _kept_for_all(plan: Plan, tp: TensorPlan) -> int:
    """What :class:`LayerInputs` keeps of ``tp`` for every candidate: where its method declares values of its
    inputs alone, its inputs as loaded and those values (per non-base input); else nothing."""
    method = plan.method_of(tp)
    if not method.from_inputs or method.lazy_inputs or tp.vocab_aligned:
        return 0
    itemsize = method_dtype(tp).itemsize
    others = len(tp.inputs) - (tp.base_index is not None)
    per_entry = len(tp.inputs) * itemsize + others * sum(v.entry_bytes(itemsize) for v in method.from_inputs)
    return numel(tp.shape) * per_entry


def largest_popsize(plans: Sequence[Plan], budget: int, hidden_bytes: int = 0, value_bytes: int = 4, *,
                    shared: bool = False) -> int:
    """The largest popsize whose :func:`generation_bytes` (``shared`` as there) fits ``budget`` (0: not even one
    candidate's)."""
    fixed = generation_bytes(plans, 1, 0, value_bytes, shared=shared)
    if fixed + hidden_bytes > budget:
        return 0
    if hidden_bytes <= 0:
        raise ValueError("hidden_bytes must be positive: with none held per candidate every popsize fits")
    return (budget - fixed) // hidden_bytes


def _reads(tp: TensorPlan) -> Iterator[InputRef]:
    """Every input byte range ``tp``'s merge reads: its inputs with their companions and LoRA factors, and the
    companions it carries."""
    yield from tp.reads()
    for _, ref in tp.carried:
        yield ref
