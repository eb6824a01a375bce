"""One output tensor computed in memory as ``run`` computes it for its shard: the same mode (whole, passes over
row chunks, or row chunks), the same kernels' threads, the same method code (:class:`~resumerge.merge.engine.compute.
TensorCompute`), so its stored parts are the bytes ``run`` writes for it. A generation's candidate (``shared``
given) merges a tensor whole where ``run`` would take statistics passes over its chunks and the whole fits: the
same bytes, in less time. Some rows of a tensor (:func:`merged_rows`: a pass's input embeddings, the rows its
texts use) are merged alone where the method makes each row's bytes those of the whole merge: an elementwise
method row run by row run, a method that declares :attr:`~resumerge.merge.methods.spec.MethodSpec.rows` from the whole
tensor's statistics (TIES' cut among the whole table's keys) with only those rows combined.

What decides the bytes is decided as the run decides it, from the run's settings alone: a whole tensor's kernels run
on the calling thread alone where the run's workers fill torch's threads (a whole-tensor sum's bits depend on the
threads it is split over: :mod:`resumerge.merge.engine.executor`), a stream's chunk kernels always do. How a tensor is
cut into row chunks never changes its bytes (a resumed run cuts them by the moment's headroom), so the chunks here
are cut by the budget without asking how the run cut them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.source import InputSources
from resumerge.machine.memory import MemoryGovernor
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.compute import SharedInputs, Stored, TensorCompute
from resumerge.merge.engine.devices import is_gpu
from resumerge.merge.engine.executor import CONCURRENCY
from resumerge.merge.engine.groupscales import GroupScales
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan import workunits
from resumerge.merge.plan.merge_plan import Plan, TensorPlan


def merged_tensor(plan: Plan, tp: TensorPlan, sources: InputSources, resources: Resources, *,
                  governor: MemoryGovernor | None = None, shared: SharedInputs | None = None,
                  scales: GroupScales | None = None) -> Stored:
    """``tp``'s stored parts (each by its name in the shard, on the host, contiguous, its companions with it): the
    bytes ``run`` writes for it, its inputs read from ``sources``. ``governor``: each step is admitted by it as the
    run admits it (the whole tensor, or each row chunk), and the budget chooses the mode as the run's does; None:
    no budget (computed as a run without one would). ``shared``: where other merges of the same inputs share what
    depends on the inputs alone (:class:`~resumerge.merge.engine.compute.SharedInputs`). ``scales``: the groups sharing
    one tensor-wide scale measured so far (:class:`~resumerge.merge.engine.groupscales.GroupScales`; None: measured for
    this tensor alone)."""
    found = (scales or GroupScales(plan)).scaled(tp, lambda member: _amax(plan, member, sources, resources, governor))
    assert found is not None  # measuring here is never stopped
    tp = found
    method = plan.method_of(tp)
    device = plan.options.device
    budget = governor.work_budget if governor is not None else None
    serial = torch.get_num_threads() <= CONCURRENCY  # as the run's pipeline decides it (executor._Pipeline.run)
    local = method.streamed is None or all(sources.rereads_cheaply(r.model, r.file) for r in tp.reads())
    mode = workunits.unit_mode(tp, method, budget, device, rereadable=local, serial=serial)
    if mode == workunits.PASSES and shared is not None and (
            budget is None or workunits.estimate_bytes(tp, method) <= budget // 4):
        # A generation's candidates: each merges the tensor whole where it fits as run's whole units do, not in
        # statistics passes over its chunks (the windows' histograms per candidate, every input chunk copied
        # again per pass): a fifth to a quarter less CPU for TIES' layers on the 1 GB bench. The bytes are the
        # same in every mode (how a tensor is cut never changes them), and generation_bytes counts the whole
        # tensor's working set already.
        mode = workunits.WHOLE
    stream = workunits.row_stream(tp, method, device) if mode in (workunits.ROWS, workunits.PASSES) else None
    work = TensorCompute(plan, tp, sources, resources, stream, shared=shared)
    if mode != workunits.ROWS:
        alone = serial and not is_gpu(device)
        with _admitted(governor, workunits.unit_bytes(tp, method, mode), tp.name), \
                serial_kernels() if alone else nullcontext():
            return work.whole()
    with serial_kernels() if stream is not None else nullcontext():
        return _in_rows(tp, work, governor)


def _amax(plan: Plan, tp: TensorPlan, sources: InputSources, resources: Resources,
          governor: MemoryGovernor | None) -> float:
    """The largest magnitude of ``tp``'s merged value (a member of a group sharing one tensor-wide scale), merged as
    the run measures it (:meth:`~resumerge.merge.engine.executor._Pipeline._amax`): the mode, kernels' threads and
    admission of its own unit."""
    method = plan.method_of(tp)
    device = plan.options.device
    budget = governor.work_budget if governor is not None else None
    serial = torch.get_num_threads() <= CONCURRENCY
    local = method.streamed is None or all(sources.rereads_cheaply(r.model, r.file) for r in tp.reads())
    mode = workunits.unit_mode(tp, method, budget, device, rereadable=local, serial=serial)
    stream = workunits.row_stream(tp, method, device) if mode in (workunits.ROWS, workunits.PASSES) else None
    estimate = (workunits.unit_bytes(tp, method, mode) if mode != workunits.ROWS
                else workunits.estimate_bytes(tp, method) + workunits.held_bytes(tp, method))
    kernels = stream is not None if mode == workunits.ROWS else serial and not is_gpu(device)
    with _admitted(governor, estimate, tp.name), serial_kernels() if kernels else nullcontext():
        return TensorCompute(plan, tp, sources, resources, stream).amax()


def merged_rows(plan: Plan, tp: TensorPlan, sources: InputSources, resources: Resources, rows: torch.Tensor, *,
                governor: MemoryGovernor | None = None, shared: SharedInputs | None = None) -> torch.Tensor | None:
    """Rows ``rows`` (int64, ascending, distinct) of ``tp`` as ``run`` stores them, merged for those rows alone
    where its method says that is exact (:func:`rows_alone`), the same bits as those rows of
    :func:`merged_tensor`; None where it is not (the caller merges the tensor whole). Arguments as there."""
    method = plan.method_of(tp)
    if is_gpu(plan.options.device) or not rows_alone(tp, method):  # (on the CPU only: where it is tested)
        return None
    serial = torch.get_num_threads() <= CONCURRENCY
    work = TensorCompute(plan, tp, sources, resources, None, shared=shared)
    # On the calling thread alone where the whole tensor's kernels would run so (merged_tensor): the same kernels.
    with serial_kernels() if serial else nullcontext():
        if method.rows is not None:  # the whole tensor's statistics, those rows combined
            with _admitted(governor, workunits.estimate_bytes(tp, method), tp.name):
                return work.selected(rows)
        # An elementwise method: each run of consecutive rows is a row chunk, merged as run merges one.
        pieces: list[torch.Tensor] = []
        for first, stop in _runs(rows):
            with _admitted(governor, workunits.estimate_bytes(tp, method, stop - first), tp.name):
                pieces.append(work.rows(first, stop)[tp.name])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def rows_alone(tp: TensorPlan, method: MethodSpec) -> bool:
    """Whether some rows of ``tp`` are merged alone by :func:`merged_rows`: a plain output of plain inputs (no
    companions, no LoRA, no re-indexed vocabulary, no experts or blocks, no copy), by an elementwise method (each
    row its own) or by one whose :attr:`~resumerge.merge.methods.spec.MethodSpec.rows` says it is exact for ``tp``'s
    parameters."""
    plain = (tp.copy_of is None and not tp.carried and tp.out_codec.plain and tp.experts is None and tp.blocks is None
             and not tp.vocab_aligned and len(tp.shape) == 2
             and all(ref.codec.plain and ref.lora is None and not ref.companions for ref in tp.inputs))
    if not plain:
        return False
    if method.rows is not None:
        return method.rows.exact(dict(tp.params), [dict(p) for p in tp.model_params])
    return workunits.can_chunk(tp, method)


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of consecutive values of ``rows`` (ascending, distinct) as ``[first, stop)`` ranges."""
    found: list[tuple[int, int]] = []
    for row in rows.tolist():
        if found and found[-1][1] == row:
            found[-1] = (found[-1][0], row + 1)
        else:
            found.append((row, row + 1))
    return found


def _in_rows(tp: TensorPlan, work: TensorCompute, governor: MemoryGovernor | None) -> Stored:
    """``tp`` computed as the run streams it to its writer (its statistics passes, then its output rows, chunk by
    chunk), the chunks' stored parts put together: the output rows of every part in order (a companion comes whole
    with the first chunk, empty with the others)."""
    method = work.plan.method_of(tp)
    chunks = _chunks(tp, method, governor)
    pass_index = 0
    while work.wants(pass_index):
        for first, stop in chunks:
            with _admitted(governor, workunits.estimate_bytes(tp, method, stop - first), tp.name):
                work.observe(pass_index, first, stop)
        pass_index += 1
    pieces: dict[str, list[torch.Tensor]] = {}
    for first, stop in chunks:
        with _admitted(governor, workunits.estimate_bytes(tp, method, stop - first), tp.name):
            for name, rows in work.rows(first, stop).items():
                pieces.setdefault(name, []).append(rows)
    return {name: rows[0] if len(rows) == 1 else torch.cat(rows) for name, rows in pieces.items()}


def _chunks(tp: TensorPlan, method: MethodSpec, governor: MemoryGovernor | None) -> list[tuple[int, int]]:
    """The row chunks of a tensor streamed in rows: as many rows as the headroom gives (at most the run's most, at
    least its floor), aligned as the run aligns them
    (:meth:`~resumerge.merge.engine.executor._Pipeline._each_chunk`)."""
    total, first, chunks = tp.shape[0], 0, []
    most = workunits.stream_rows(tp, method)
    floor = min(most, workunits.floor_rows(tp, method))
    row = max(1, workunits.estimate_bytes(tp, method, rows=1))
    while first < total:
        room = governor.chunk_rows(row, total - first) if governor is not None else most
        rows = workunits.aligned_rows(tp, max(1, min(total - first, most, max(floor, room))), total - first)
        chunks.append((first, first + rows))
        first += rows
    return chunks


@contextmanager
def _admitted(governor: MemoryGovernor | None, estimate: int, what: str) -> Iterator[None]:
    """The block run with ``estimate`` bytes reserved from ``governor`` (nothing without one)."""
    reservation: AbstractContextManager[object] = (
        governor.acquire(estimate, what=what) if governor is not None else nullcontext())
    with reservation:
        yield
