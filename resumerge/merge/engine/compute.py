"""One output tensor from its inputs, computed as passes over row chunks, the whole tensor being one chunk.

:class:`TensorCompute` is the engine's one compute path: every merged tensor, whole or streamed in rows, on the CPU
or a GPU, and ``plan``'s timing on sample rows, runs its method's statistics passes (none unless it is computed
from several chunks by its :class:`~resumerge.merge.methods.spec.RowStream`) and then its output pass, over chunks of
rows read, cast and moved to the plan's device; the result comes back in the planned dtype. The caller chooses the rows
of each step (see :mod:`resumerge.merge.plan.workunits` for when the engine takes which) and holds the memory governor's
reservations. A copy (``copy_of``) runs no method: its rows are its input's stored bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Protocol, overload

from resumerge.errors import ResumergeError
from resumerge.inputs.adapters import apply_lora_rows
from resumerge.inputs.codecs import MAIN, SharedScale
from resumerge.inputs.safetensors_format import numel
from resumerge.inputs.source import InputSources
from resumerge.inputs.tensorio import NAME_DTYPES, TORCH_DTYPES
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.blocks import merge_by_block
from resumerge.merge.engine.experts import merge_by_expert
from resumerge.merge.engine.workspace import WARM_BYTES, Workspace
from resumerge.merge.methods.registry import MergeContext, MethodSpec
from resumerge.merge.methods.resources import Resources
from resumerge.merge.methods.spec import InputsMemo, InputsOnly, RowStream
from resumerge.merge.plan.inputrefs import read_value
from resumerge.merge.plan.merge_plan import InputRef, Plan, TensorPlan
from resumerge.merge.plan.workunits import aligned_rows, can_chunk, chunk_plan, method_dtype, pass_rows
from resumerge.merge.vocab import align_rows

if TYPE_CHECKING:
    from resumerge.inputs.codecs.protocol import Lend

# The most float32 bytes of one input a tensor computed in a workspace is decoded into at once: a larger tensor of an
# elementwise method with encoded (quantized) inputs or output is computed in row chunks of about this size, each in
# the workspace's buffers, so that they stay this small. Whole, a GGUF model's 32000 x 2048 embedding grew every
# worker's three buffers (two inputs, the result) to 250 MB each, whose first touch the kernel zero-fills page by
# page: ~20 % of a 1 GB GGUF -> GGUF merge's CPU (bench/RESULTS.md, GGUF).
WORKSPACE_CHUNK_BYTES = 32 << 20


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one output tensor: depends only on (seed, name), never on execution order."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{name}".encode()).digest()[:8], "little") & (2**63 - 1)


# An output tensor (or its rows) as stored: each stored part by its name in the shard, on the host, contiguous (a
# plain output is one part, named as the tensor).
Stored = dict[str, "torch.Tensor"]


class SharedInputs(Protocol):
    """Where several merges of the same inputs (a generation's candidates) share what depends on the inputs alone,
    per chunk (``key``: the chunk's inputs): the inputs as loaded (read, cast) and the values its method declares
    from them (:attr:`~resumerge.merge.methods.spec.MethodSpec.from_inputs`). Only a method that declares such values
    is handed the shared inputs: it never writes its inputs (they are not its own: ``owned_inputs`` False)."""

    def loaded(self, key: Hashable, load: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        """The chunk's inputs as ``load()`` gives them, loaded once for every merge of them."""
        ...

    def memo(self, key: Hashable, declared: tuple[InputsOnly, ...]) -> InputsMemo:
        """Where the chunk's declared values are kept for every merge of it (only those ``declared``)."""
        ...


def compute_tensor(plan: Plan, tp: TensorPlan, sources: InputSources, resources: Resources,
                   stream: RowStream | None = None) -> Stored:
    """``tp`` computed whole (:meth:`TensorCompute.whole`): by its method's function over the tensor as one chunk,
    or by ``stream`` over row chunks (each pass re-reading them from ``sources``) into the same bits."""
    return TensorCompute(plan, tp, sources, resources, stream).whole()


class TensorCompute:
    """How the output tensor ``tp`` is computed, step by step.

    The engine asks :meth:`wants` for ``k = 0, 1, ...`` (each once, in order) and, while it says yes, feeds
    :meth:`observe` every row range of ``tp`` in order (statistics pass ``k``); then it asks :meth:`rows` for every
    row range in order, each returning those output rows as stored. Ranges of different passes may be cut
    differently. Without a ``stream`` there is no statistics pass and each range is one chunk handed to the
    method's function (the whole tensor's rows when it fits, an elementwise method's rows otherwise; a fused expert
    stack is merged expert by expert); with one, each range is cut into chunks of
    :func:`~resumerge.merge.plan.workunits.pass_rows` rows. ``load`` turns a chunk's plan into its context (default: the
    inputs read from ``sources`` by :func:`load_context`, holding the run's ``resources``); ``plan``'s timing hands
    in contexts already in memory. A tensor computed as one chunk by the default ``load`` may be handed a
    :class:`~resumerge.merge.engine.workspace.Workspace` (:meth:`whole`): its quantized inputs are decoded into the
    workspace's buffers and the method is lent its result buffer. Failures of the method are raised as
    :class:`ResumergeError` naming ``tp``. ``shared``: where other merges of the same inputs (a generation's
    candidates) share each chunk's loaded inputs and its method's declared values (:class:`SharedInputs`).
    """

    def __init__(self, plan: Plan, tp: TensorPlan, sources: InputSources, resources: Resources,
                 stream: RowStream | None = None, load: Callable[[TensorPlan], MergeContext] | None = None,
                 shared: SharedInputs | None = None) -> None:
        self.plan, self.tp, self.sources, self.stream = plan, tp, sources, stream
        self.total = tp.shape[0] if tp.shape else 1  # a 0-d tensor is one row
        self._resources, self._given, self._shared = resources, load, shared

    def held_bytes(self) -> int:
        """What the stream keeps from its first chunk to its last (0 without one): reserved for all its passes."""
        return self.stream.held_bytes() if self.stream is not None else 0

    def wants(self, pass_index: int) -> bool:
        """Whether statistics pass ``pass_index`` must run before the output rows."""
        return self.stream is not None and self.stream.wants(pass_index)

    def observe(self, pass_index: int, first: int, stop: int) -> None:
        """Statistics pass ``pass_index`` over rows ``[first, stop)``."""
        stream = self.stream
        assert stream is not None  # wants() is False without one
        for start, end in self._chunks(first, stop):
            part = self._part(start, end)
            with self._failures():
                stream.observe(pass_index, self._load(part))

    def rows(self, first: int, stop: int, workspace: Workspace | None = None) -> Stored:
        """Output rows ``[first, stop)`` on the host as stored (each part's rows of those rows), with the companions
        ``tp`` carries when they are its first rows; computed in ``workspace``'s buffers when given and the rows
        are one chunk, or chunks cut to keep those buffers small (:meth:`_workspace_chunks`; nothing returned
        points into them)."""
        if self.tp.copy_of is not None:
            return _copy(self._part(first, stop), self.sources)
        chunks = self._chunks(first, stop)
        lent = None  # the stream's chunks are never computed in the workspace: a stream may keep what they hold
        if len(chunks) == 1 and workspace is not None:
            chunks, lent = self._workspace_chunks(first, stop), workspace
        # One chunk whose codec writes straight into its parts is encoded into buffers lent as the chunks' are:
        # encode() returned a fresh tensor of the output's size (an F16 GGUF's q/k/v), its pages zeroed by the kernel.
        straight = lent is not None and lent.passes_on and self.tp.out_codec.writes_into
        if len(chunks) == 1 and not straight:
            out = self._output(first, stop, workspace)
        else:  # the chunks, each encoded, land in the range's buffers
            out = self._range_buffers(first, stop, lent)
            at = dict.fromkeys(out, 0)
            for start, end in chunks:
                if lent is not None:  # encoded straight into the range's buffers
                    self._encode_into(start, end, lent, out, at)
                    continue
                _land(out, at, self._output(start, end, lent))
            if lent is not None:
                out = {name: _handed(t, lent) for name, t in out.items()}
        return self._with_companions(out, first)

    def rows_then(self, first: int, stop: int) -> Callable[[], Stored]:
        """:meth:`rows` without a workspace in two steps: the method's results for rows ``[first, stop)`` now, on
        the calling thread (a stream's next rows: its chunks in order), and their encoding with the companions by
        the function returned, which any one thread may call once (the same bytes wherever it runs: a chunk's
        encoding depends on its rows alone). Not for a copy (:attr:`~resumerge.merge.plan.merge_plan.TensorPlan.
        copy_of`)."""
        merged = [(start, end, self.merged(start, end)) for start, end in self._chunks(first, stop)]

        def encoded() -> Stored:
            if len(merged) == 1:
                out = _finish(self._part(first, stop), merged[0][2])
            else:
                out = self._range_buffers(first, stop)
                at = dict.fromkeys(out, 0)
                while merged:
                    start, end, value = merged.pop(0)  # each result dropped once encoded
                    _land(out, at, _finish(self._part(start, end), value))
            return self._with_companions(out, first)

        return encoded

    def _range_buffers(self, first: int, stop: int, workspace: Workspace | None = None) -> dict[str, torch.Tensor]:
        """Each stored part's buffer for output rows ``[first, stop)``, where the range's chunks land encoded: lent
        by ``workspace`` where it passes its buffers on to the writer (then handed over, :func:`_handed`), so that
        the output's bytes are written into pages the writer gave back rather than fresh ones the kernel zeroes
        (an F16 GGUF of two 0.94 GB models: 0.95 GB of them); else fresh."""
        parts = self.tp.out_codec.out_parts(self.tp.name, self.tp.out_dtype, (stop - first, *self.tp.shape[1:]))
        if workspace is None or not workspace.passes_on:
            return {p.name: torch.empty(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in parts}
        return {p.name: workspace.take(f"out:{p.part}", p.shape, TORCH_DTYPES[p.dtype]) for p in parts}

    def _with_companions(self, out: Stored, first: int) -> Stored:
        """``out`` (rows from ``first``) with the companions ``tp`` carries: written once, with the first rows."""
        whole = first == 0 and all(r.first_row == 0 for r in self.tp.inputs)
        return {**out, **_carried(self.tp, self.sources, whole=whole)}

    def whole(self, workspace: Workspace | None = None) -> Stored:
        """Every statistics pass over all of ``tp``'s rows, then all its output rows (in ``workspace``'s buffers
        when given: see :meth:`rows`)."""
        pass_index = 0
        while self.wants(pass_index):
            self.observe(pass_index, 0, self.total)
            pass_index += 1
        return self.rows(0, self.total, workspace)

    def amax(self) -> float:
        """The largest magnitude of ``tp``'s output as its codec measures it for the group whose tensor-wide scale it
        shares (:class:`~resumerge.inputs.codecs.SharedScale`): every statistics pass, then its output rows merged
        as :meth:`whole` merges them, none encoded."""
        codec = self.tp.out_codec
        if not isinstance(codec, SharedScale):
            raise ResumergeError(f"internal: {self.tp.name} shares no tensor-wide scale", tensor=self.tp.name)
        pass_index = 0
        while self.wants(pass_index):
            self.observe(pass_index, 0, self.total)
            pass_index += 1
        found = 0.0
        for start, end in self._chunks(0, self.total):
            found = max(found, codec.amax_of(self.merged(start, end)))
        return found

    def selected(self, rows: torch.Tensor) -> torch.Tensor:
        """Output rows ``rows`` (int64, ascending, distinct) of a plain output without companions, as stored: by
        its method's :attr:`~resumerge.merge.methods.spec.MethodSpec.rows` over the whole tensor's context (its
        statistics of all of it; shared where :class:`SharedInputs` shares them), only those rows combined."""
        method = self.plan.method_of(self.tp)
        if method.rows is None:
            raise ValueError(f"internal: {method.name} merges no rows alone")
        with self._failures():
            out = method.rows.merge(self._load(self.tp), rows)
        return _finish(self.tp, out)[self.tp.name]

    def _encode_into(self, first: int, stop: int, workspace: Workspace, out: dict[str, torch.Tensor],
                     at: dict[str, int]) -> None:
        """Rows ``[first, stop)`` computed in ``workspace`` and encoded into ``out``'s stored parts from ``at`` (each
        part's next row, advanced): no chunk-sized encoded tensor between, which would be fresh pages each time."""
        codec = self._part(first, stop).out_codec  # the chunk's (its rows' own weights: TensorEncoder.from_row)
        parts = codec.out_parts(self.tp.name, self.tp.out_dtype, (stop - first, *self.tp.shape[1:]))
        into = {p.part: out[p.name][at[p.name] : at[p.name] + p.shape[0]] for p in parts}
        with self._failures():
            codec.encode_into(self.merged(first, stop, workspace), self.tp.out_dtype, into, lend=workspace.take)
        for p in parts:
            at[p.name] += p.shape[0]

    def _workspace_chunks(self, first: int, stop: int) -> list[tuple[int, int]]:
        """Rows ``[first, stop)`` of a tensor computed in a workspace as chunks of about
        :data:`WORKSPACE_CHUNK_BYTES` per input, for an elementwise method on the CPU whose inputs are decoded or
        whose output is encoded (a plain one would be copied once more); else one chunk."""
        tp, whole = self.tp, [(first, stop)]
        if (self.stream is not None or tp.experts is not None or self.plan.options.device != "cpu"
                or not can_chunk(tp, self.plan.method_of(tp))
                or (tp.out_codec.plain and all(ref.codec.plain for ref in tp.inputs))):
            return whole
        row = 4 * max(1, numel(tp.shape[1:]))
        if (stop - first) * row <= WORKSPACE_CHUNK_BYTES:
            return whole
        chunks, start = [], first
        while start < stop:
            end = start + aligned_rows(tp, max(1, WORKSPACE_CHUNK_BYTES // row), stop - start)
            chunks.append((start, end))
            start = end
        return chunks

    def _chunks(self, first: int, stop: int) -> list[tuple[int, int]]:
        step = pass_rows(self.tp) if self.stream is not None else max(1, stop - first)
        return [(start, min(stop, start + step)) for start in range(first, stop, step)] or [(first, stop)]

    def _part(self, first: int, stop: int) -> TensorPlan:
        return self.tp if (first, stop) == (0, self.total) else chunk_plan(self.tp, first, stop)

    def merged(self, first: int, stop: int, workspace: Workspace | None = None) -> torch.Tensor:
        """The method's result for rows ``[first, stop)`` as one chunk (the stream's next output rows, when it has
        one), on the plan's device, before it is encoded; it may be in ``workspace``'s buffers (a stream's chunks
        never are: a stream may keep what its chunks' contexts hold)."""
        part = self._part(first, stop)
        with self._failures():
            if self.stream is not None:
                return self.stream.apply(self._load(part))
            if part.blocks is not None:  # each output layer's block merged on its own
                return merge_by_block(part, self._load(part), self.plan.method_of(part).fn, self._generator)
            if part.experts is not None:  # each expert's projections merged on their own
                return merge_by_expert(part, partial(self._load, workspace=workspace), self.plan.method_of(part).fn)
            return self.plan.method_of(part).fn(self._load(part, workspace))

    def _load(self, part: TensorPlan, workspace: Workspace | None = None) -> MergeContext:
        """The context of ``part``: by the ``load`` given, else read from the sources (into ``workspace``)."""
        if self._given is not None:
            return self._given(part)
        method = self.plan.method_of(part)
        if (self._shared is None or not method.from_inputs or method.lazy_inputs or workspace is not None
                or part.vocab_aligned):  # (re-indexed rows: by each plan's own tokenizer alignment)
            return load_context(self.plan, part, self.sources, method, self._resources, workspace)
        # The chunk's inputs, cast, and the values its method declares of them: the same for every merge of them.
        key = (part.name, part.inputs, part.compute_dtype, part.vocab_aligned, self.plan.options.device)
        tensors = self._shared.loaded(
            key, lambda: load_context(self.plan, part, self.sources, method, self._resources).tensors)
        return make_context(self.plan, part, method, tensors, self._resources,
                            memo=self._shared.memo(key, method.from_inputs))

    def _generator(self, name: str) -> torch.Generator:
        """A generator seeded from (the run's seed, ``name``), on the plan's device."""
        device = torch.device(self.plan.options.device)
        return torch.Generator(device=device).manual_seed(tensor_seed(self.plan.options.random_seed, name))

    def _output(self, first: int, stop: int, workspace: Workspace | None = None) -> Stored:
        """Output rows ``[first, stop)`` as one chunk, encoded as stored (without the companions)."""
        return _finish(self._part(first, stop), self.merged(first, stop, workspace), workspace)

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """A method's ``ValueError`` (bad inputs for it) as the run's error, naming the tensor."""
        try:
            yield
        except ValueError as exc:
            raise ResumergeError(f"{self.tp.method} failed on {self.tp.name}: {exc}", tensor=self.tp.name) from exc


def load_context(plan: Plan, tp: TensorPlan, sources: InputSources, method: MethodSpec, resources: Resources,
                 workspace: Workspace | None = None) -> MergeContext:
    """The :class:`MergeContext` of ``tp`` (a whole tensor or a row chunk): its inputs read, cast and moved to the
    plan's device, its parameters resolved (read when the method indexes them, for a ``lazy_inputs`` method), the
    run's ``resources`` handed on. With a ``workspace`` (not for a ``lazy_inputs`` method, whose every access must
    be a buffer of its own), quantized inputs are decoded into its buffers and the method is lent its result
    buffer (:meth:`~resumerge.merge.methods.spec.MergeContext.result_buffer`)."""
    device = torch.device(plan.options.device)
    on_gpu = device.type != "cpu"
    if method.lazy_inputs and not tp.vocab_aligned:
        lazy = _LazyInputs(tp, sources, device)
        return make_context(plan, tp, method, lazy, resources, owned=True, read_rows=lazy.rows)
    tensors = []
    for i, ref in enumerate(tp.inputs):
        t = _read_input(ref, sources, _decode_buffer(ref, i, workspace), _raw_buffer(ref, i, workspace))
        if on_gpu:
            t = t.to(device)
        if tp.compute_dtype is not None:
            t = t.to(NAME_DTYPES[tp.compute_dtype])
        tensors.append(t)
    if tp.vocab_aligned:
        # Re-index every input's vocabulary rows to the output tokenizer before the method sees them; the
        # result shares one (promoted) dtype.
        assert plan.vocab is not None
        base = tp.inputs[tp.base_index].model if tp.base_index is not None else None
        tensors = align_rows(plan.vocab, tensors, [ref.model for ref in tp.inputs], base=base)
    if tp.compute_dtype is None and len({t.dtype for t in tensors}) > 1:
        # Like mergekit, inputs stored in different dtypes meet in their common (promoted) dtype.
        common = method_dtype(tp)
        tensors = [t.to(common) for t in tensors]
    lend = workspace.take if workspace is not None else None
    return make_context(plan, tp, method, tensors, resources, lend=lend)


def make_context(plan: Plan, tp: TensorPlan, method: MethodSpec, tensors: Sequence[torch.Tensor],
                 resources: Resources, *, owned: bool = False,
                 read_rows: Callable[[int, int, int], torch.Tensor] | None = None,
                 lend: Lend | None = None,
                 memo: InputsMemo | None = None) -> MergeContext:
    """The context ``method`` sees for ``tp`` over its prepared ``tensors`` (on the plan's device): its resolved
    parameters, a generator seeded from (the run's seed, ``tp``'s name) when it draws at random, the run's
    ``resources``, ``lend`` for its result buffer and ``memo`` where its declared values of the inputs are shared."""
    generator = None
    if method.randomized:
        generator = torch.Generator(device=torch.device(plan.options.device)).manual_seed(
            tensor_seed(plan.options.random_seed, tp.name))
    return MergeContext(
        tensors=tensors,
        base_index=tp.base_index,
        model_params=[dict(p) for p in tp.model_params],
        params=dict(tp.params),
        generator=generator,
        owned_inputs=owned,
        read_rows=read_rows,
        resources=resources,
        lend=lend,
        memo=memo,
    )


class _LazyInputs(Sequence["torch.Tensor"]):
    """A unit's inputs as :func:`load_context` prepares them, each read when indexed — and read again at every
    access: nothing is kept here, so an input the method has finished with is freed as soon as it lets go of it
    (a module's base weight, once the task vector is taken). Each access returns a buffer of its own."""

    def __init__(self, tp: TensorPlan, sources: InputSources, device: torch.device) -> None:
        self._tp, self._sources, self._device = tp, sources, device
        self._common: torch.dtype | None = None
        if tp.compute_dtype is not None:
            self._common = NAME_DTYPES[tp.compute_dtype]
        elif len({ref.value_dtype for ref in tp.inputs}) > 1:
            self._common = method_dtype(tp)  # as the eager path promotes them

    def __len__(self) -> int:
        return len(self._tp.inputs)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self._read(i) for i in range(len(self))[index]]
        return self._read(range(len(self))[index])

    def rows(self, i: int, first: int, stop: int) -> torch.Tensor:
        """Rows ``[first, stop)`` of input ``i``, read and prepared as a whole input is."""
        return self._read(i, self._tp.inputs[i].rows(first, stop))

    def _read(self, i: int, ref: InputRef | None = None) -> torch.Tensor:
        t = _read_input(ref if ref is not None else self._tp.inputs[i], self._sources)
        if self._device.type != "cpu":
            t = t.to(self._device)
        return t.to(self._common) if self._common is not None else t


def _land(out: dict[str, torch.Tensor], at: dict[str, int], rows: Stored) -> None:
    """A chunk's encoded ``rows`` copied into the range's buffers ``out`` at each part's next row (``at``, advanced)."""
    for name, value in rows.items():
        out[name][at[name] : at[name] + value.shape[0]] = value
        at[name] += value.shape[0]


def _finish(tp: TensorPlan, out: torch.Tensor, workspace: Workspace | None = None) -> Stored:
    """A method's result encoded by ``tp``'s output codec (a plain one: cast to the planned dtype) as its stored
    parts, on the host, contiguous (the companions it carries aside: :func:`_carried`), none of them in
    ``workspace``'s buffers (a float32 result stored as float32 is copied out, or its buffer passed on to the
    writer: :meth:`~resumerge.merge.engine.workspace.Workspace.pass_on`)."""
    names = {p.part: p.name for p in tp.out_codec.out_parts(tp.name, tp.out_dtype, tp.shape)}
    parts = tp.out_codec.encode(out, tp.out_dtype)
    if set(parts) != set(names):
        raise ResumergeError(f"internal: {tp.name} is encoded as {sorted(parts)}, planned as {sorted(names)}")
    stored = {}
    for part, t in parts.items():
        if t.device.type != "cpu":
            t = t.cpu()  # a blocking copy: the GPU memory of this unit is free once it returns
        if workspace is not None:
            t = _handed(t, workspace)
        stored[names[part]] = t.contiguous()
    return stored


def _handed(t: torch.Tensor, workspace: Workspace) -> torch.Tensor:
    """``t`` (a stored part in one of ``workspace``'s buffers, or not) stored as it is: its buffer passed on to the
    writer, which gives it back once written; copied out where it cannot be (nothing then points into the
    workspace)."""
    if workspace.holds(t) and not workspace.pass_on(t):
        return t.clone()
    return t


def _carried(tp: TensorPlan, sources: InputSources, *, whole: bool) -> Stored:
    """The companions ``tp`` carries (:attr:`~resumerge.merge.plan.merge_plan.TensorPlan.carried`) by stored name: their
    input's stored bytes when ``whole`` (a whole tensor or its first row chunk), else no bytes (a later chunk)."""
    names = {p.part: p.name for p in tp.stored_parts()}
    if whole:
        return {names[part]: sources.read(r.model, r.file, r.start, r.end, r.dtype, r.shape).contiguous()
                for part, r in tp.carried}
    return {names[part]: torch.empty((0, *r.shape[1:]), dtype=TORCH_DTYPES[r.dtype]) for part, r in tp.carried}


def _copy(tp: TensorPlan, sources: InputSources) -> Stored:
    """The stored parts of ``tp``'s input ``copy_of`` (the planner checked they are the parts ``tp`` is stored as),
    by ``tp``'s stored names."""
    ref = tp.inputs[tp.copy_of or 0]
    names = {p.part: p.name for p in tp.stored_parts()}
    carried = dict(tp.carried)  # the copied input's own (see out_format), written once: with the first rows
    return {**{names[part]: sources.read(r.model, r.file, r.start, r.end, r.dtype, r.shape).contiguous()
               for part, r in ((MAIN, ref), *ref.companions) if part not in carried},
            **_carried(tp, sources, whole=ref.first_row == 0)}


def _decode_buffer(ref: InputRef, index: int, workspace: Workspace | None) -> torch.Tensor | None:
    """Where input ``index`` (``ref``) is decoded: ``workspace``'s buffer for it, or None (a plain input is the
    buffer read)."""
    if workspace is None or ref.codec.plain:
        return None
    return workspace.take(f"input{index}", ref.value_shape, TORCH_DTYPES[ref.codec.value_dtype(ref.dtype)])


def _raw_buffer(ref: InputRef, index: int, workspace: Workspace | None) -> torch.Tensor | None:
    """Where input ``index``'s stored bytes are read (before they are decoded, for a quantized one): ``workspace``'s
    buffer for them, or None (a fresh one). A plain input's buffer read is its value, and the method reads it where
    it lies: a linear merge of two 1.74 GB models read into fresh buffers faulted in and zeroed 3.5 GB of pages, a
    GGUF input's 2 GB as many."""
    if workspace is None or (ref.codec.plain and ref.end - ref.start < WARM_BYTES):
        return None  # a small plain input's fresh buffer comes from warm pages
    return workspace.take(f"raw{index}", (ref.end - ref.start,), torch.uint8)


def _read_input(ref: InputRef, sources: InputSources, out: torch.Tensor | None = None,
                raw: torch.Tensor | None = None) -> torch.Tensor:
    """One input tensor as the method sees it: read with its companions and decoded by ``ref.codec`` (a plain one
    returns the buffer read; a decoding one into ``out`` when given), cast to ``ref.cast``
    (:func:`~resumerge.merge.plan.inputrefs.read_value`), with its LoRA delta merged (in the stored dtype, as PEFT's
    merge_and_unload does, before any ``dtype:`` of the config)."""
    t = read_value(ref, sources, out, raw)  # a quantized decode runs on this thread alone (see read_value)
    if ref.lora is not None:
        lora = ref.lora
        t = apply_lora_rows(t, read_value(lora.a, sources), read_value(lora.b, sources), lora.scale,
                            lora.fan_in_fan_out, first_row=ref.first_row, embedding=lora.embedding)
    return t
