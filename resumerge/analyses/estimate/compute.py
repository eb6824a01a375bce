"""How long the merge methods of a plan will compute here, measured on a sample of the plan's own tensors.

The pending tensors are grouped by what decides a method's cost per element: the method, the dtype it computes
in, the device, and its non-numeric parameters (a ``normalize`` flag changes the work; a density from a gradient
does not change how much there is). In each group the tensor shapes that hold most of its elements (one tensor
per row length: the 2-D projection and MLP matrices dominate) are sampled — their leading whole rows, with that
tensor's own resolved parameters — and :func:`~resumerge.analyses.estimate.method_timing.measure_rate` times the
engine's own compute step on them as a run's worker computes a whole tensor, in a
:class:`~resumerge.merge.engine.workspace.Workspace` (:meth:`~resumerge.merge.engine.compute.TensorCompute.merged`, the
rows as one chunk: a fused expert stack merged expert by expert), with the two costs around it that the run pays per
element too: the read and decode of quantized inputs into the workspace's buffers, in each timed call (the bytes
in the page cache after a warm-up: the plan prices the disk's time apart), and the output codec's encode (a cast
for a plain output). Plain inputs are read once, through the same :class:`~resumerge.inputs.source.InputSources`
and preparation the engine uses, and kept in memory. Each sample's figure is its fastest call; where the run's
workers each compute on one thread (a CPU whose cores they fill) the sample runs on one thread too and is timed
by that thread's CPU time, so neither the work ``plan`` does beside it nor a busy machine changes much: at load
8-9 five samples of DeepSeek-V3 x R1's FP8 group came within -8/+15 % of their median, where the mean wall time
of two threads spread 4.2-109 ns/element at load 2 and 28-85 h at load 8. One exception: a whole-cost method's
call (a LoRA extraction's decomposition) is timed by the wall clock, as its linear algebra (``eigh``, ``svd``,
matrix products) runs on the BLAS library's own threads (MKL's in torch's x86 wheels), which serial kernels do not
hold to one (on two threads its thread's CPU counted half of the process's). The group's seconds per element
times its pending elements is its compute time, shared by the tensors the run computes at once.

Everything is bounded: at most :data:`SAMPLE_BYTES` read from the inputs and about :data:`SAMPLE_SECONDS` of
timing for the whole plan, split between the groups. Inputs that are not on disk (hub files not downloaded, a
recipe's earlier stage not run yet) are not fetched: the method is timed on synthetic tensors of the same shape
and dtype (a random base and small deltas, like a fine-tune), which every result says, since a method's cost
depends on the shapes, not the values — except iterative ones (karcher) that stop when they converge.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.analyses.estimate.computegroup import ComputeGroup
from resumerge.analyses.estimate.method_timing import DEFAULT_SAMPLE_ELEMENTS, Timing, measure_rate
from resumerge.analyses.estimate.synthetic import synthetic_inputs
from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.safetensors_format import numel
from resumerge.inputs.source import InputSources
from resumerge.inputs.tensorio import DTYPE_NAMES, TORCH_DTYPES
from resumerge.machine.torch_import import dtype_name, torch
from resumerge.merge.engine.compute import TensorCompute, load_context, make_context
from resumerge.merge.engine.workspace import UNBUDGETED, Workspace
from resumerge.merge.methods.registry import MergeContext, MethodSpec, get_method
from resumerge.merge.methods.resources import NO_RESOURCES, Resources
from resumerge.merge.plan.fusedscales import measured_before
from resumerge.merge.plan.merge_plan import InputRef, Plan, ShardPlan, TensorPlan
from resumerge.merge.plan.workunits import chunk_plan
from resumerge.outputs.containers import SAFETENSORS

if TYPE_CHECKING:
    from resumerge.analyses.estimate.torchside import TorchSide

# Input bytes read for all samples of a plan together: a few tens of MB reads in well under a second from any
# disk the merge itself could use.
SAMPLE_BYTES = 32 * 1024 * 1024
# Seconds of timing for a whole plan (warm-ups and repeats included, roughly): `plan` must stay quick, and the
# helper process times it while the planning process estimates the rest. (Timed by one thread's CPU, five samples
# of DeepSeek-V3 x R1's FP8 group gave 0.54-0.67 h at 1.5 s and 0.54-0.69 h at 3 s, paired, at load 8-9: a longer
# sample was no steadier; bench/RESULTS.md, issue 45.)
SAMPLE_SECONDS = 1.5
# Shape classes sampled per group at most; the largest few hold nearly all elements of a transformer.
MAX_SHAPES = 3
# Stop adding shape classes once the sampled ones hold this share of the group's elements.
COVERAGE = 0.9
# Each sample is timed over a window of calls this long (its fastest call counts: more calls, more chances of
# one that nothing slowed; see measure_rate), for groups large enough that their compute time matters.
WINDOW_SECONDS = 0.3
# Below this many pending elements a group computes in about a second even at 100 ns per element: a few calls
# are precise enough, and `plan` on small models (the tests') stays instant.
PRECISE_ELEMENTS = 10_000_000
# One row at least is sampled even when the byte budget is spent, so every group gets a rate.
_MIN_ROWS = 1


@dataclass
class _Group:
    """The pending tensors of one cost group, and its shape classes by pending elements."""

    method: str
    dtype: str
    tensors: list[TensorPlan]
    key: tuple[Any, ...] = ()
    # Tensors computed once more (NVFP4's group-scale pass: :func:`~resumerge.merge.plan.fusedscales.measured_before`)
    again: list[TensorPlan] = field(default_factory=list)

    @property
    def elements(self) -> int:
        return sum(numel(tp.shape) for tp in self.tensors) + sum(numel(tp.shape) for tp in self.again)

    def representatives(self) -> list[TensorPlan]:
        """One tensor per row shape, largest classes first, until they cover :data:`COVERAGE` of the group.

        Vocabulary-aligned tensors are left out (their rows are gathered from other rows first: a slice of
        them is not a smaller instance of the same work); they are priced at the group's rate.
        """
        classes: dict[tuple[int, ...], list[TensorPlan]] = defaultdict(list)
        for tp in self.tensors + self.again:
            if not tp.vocab_aligned and tp.shape and numel(tp.shape) > 0:
                key = (len(tp.inputs), *tp.shape[1:])
                classes[key].append(tp)
        ranked = sorted(classes.values(), key=lambda c: -sum(numel(tp.shape) for tp in c))
        chosen: list[TensorPlan] = []
        covered, total = 0, max(1, self.elements)
        for members in ranked[:MAX_SHAPES]:
            if chosen and covered >= COVERAGE * total:
                break
            chosen.append(members[0])
            covered += sum(numel(tp.shape) for tp in members)
        return chosen

    def sample(self) -> _Sample:
        every = self.tensors + self.again
        return _Sample(self.method, self.dtype, self.key, len(every), self.elements, tuple(self.representatives()),
                       every[0])


@dataclass(frozen=True)
class _Sample:
    """What measuring a group needs: its size, and the tensors sampled (``chosen`` by rows, ``first`` whole)."""

    method: str
    dtype: str
    key: tuple[Any, ...]
    tensors: int
    elements: int
    chosen: tuple[TensorPlan, ...]
    first: TensorPlan


def measure_compute(plan: Plan, pending: Sequence[ShardPlan], *, sources: InputSources | None = None,
                    max_bytes: int = SAMPLE_BYTES, max_seconds: float = SAMPLE_SECONDS,
                    serial: bool | None = None, workers: int = 1,
                    side: TorchSide | None = None, resources: Resources = NO_RESOURCES) -> tuple[ComputeGroup, ...]:
    """Time the methods of the ``pending`` shards of ``plan`` on samples and scale to their pending elements.

    ``sources`` reads the inputs (default: every model from its folder, as ``resumerge run`` reads local
    models); at most ``max_bytes`` are read through it. ``max_seconds`` 0 measures nothing (every group comes
    back unmeasured). Where the engine's ``workers`` fill torch's threads on the CPU (``serial``; None: when
    torch's threads are no more than ``workers``) each computes its tensor on one thread, that many at once: the
    sample is then timed on one thread, by its CPU time, and its cost shared by them. A method with a
    :class:`~resumerge.merge.methods.spec.WholeCost` is timed by one call per class on synthetic inputs of the real
    shapes, whatever ``max_seconds`` leaves (a sample of rows is not a smaller instance of a decomposition). Never
    raises for a method that fails on a sample: that group is left unmeasured with the reason, and the run will
    report the failure itself.

    The pending tensors are grouped here; the groups are measured where ``side`` runs calls that need torch (None:
    in this process). A :class:`~resumerge.analyses.estimate.torchside.TorchProcess` gets only the sampled tensors'
    plans and reads their rows itself (``sources`` must then be None). ``resources``: the run's (its units' shared
    objects), which a method with a :class:`~resumerge.merge.methods.spec.ScaledProbe` is timed with, on its real
    inputs.
    """
    return start_compute(plan, pending, sources=sources, max_bytes=max_bytes, max_seconds=max_seconds,
                         serial=serial, workers=workers, side=side, resources=resources)()


def start_compute(plan: Plan, pending: Sequence[ShardPlan], *, sources: InputSources | None = None,
                  max_bytes: int = SAMPLE_BYTES, max_seconds: float = SAMPLE_SECONDS, serial: bool | None = None,
                  workers: int = 1, side: TorchSide | None = None,
                  resources: Resources = NO_RESOURCES) -> Callable[[], tuple[ComputeGroup, ...]]:
    """:func:`measure_compute`, started: the pending tensors are grouped now; what it returns gives the groups,
    waiting for them if need be. Where every sample is timed by its thread's CPU (:func:`_thread_timed`, and no
    whole-cost method: those are timed by the wall clock) they are sent to ``side`` now, which measures them while
    this process goes on (a helper process; :class:`~resumerge.analyses.estimate.torchside.TorchHere` and None measure
    when the result is asked for): work beside them does not change that figure. Elsewhere ``side`` measures them when
    the result is asked for, when nothing else runs here."""
    samples = [g.sample() for g in _groups(plan, pending, _promoted if side is None else partial(side.call, _promoted))]
    if side is None or not samples:
        return partial(_measure_samples, plan, samples, sources, max_bytes, max_seconds, serial, workers, resources)
    assert sources is None, "a helper process reads the inputs itself"
    kept = {tp.name: tp for s in samples for tp in (*s.chosen, s.first)}
    # Only what the sampled tensors' computations read: their plans, the inputs' folders, options and vocabulary.
    small = replace(plan, tensors=kept, shards=(), parts=(), notes=(), filters=(), accounting=None,
                    tokenizer_blobs={}, container=SAFETENSORS)
    args = (small, samples, None, max_bytes, max_seconds, serial, workers, resources)
    specs = [get_method(s.method, plan.units) for s in samples]
    whole = any(spec is not None and (spec.whole_cost is not None or spec.scaled_probe is not None) for spec in specs)
    if not whole and side.call(_thread_timed, plan.options.device, serial, workers):
        return side.submit(_measure_samples, *args)
    return partial(side.call, _measure_samples, *args)


def _thread_timed(device: str, serial: bool | None, workers: int) -> bool:
    """Whether a sample on ``device`` is timed on one thread by its CPU time, where torch is: where the run's
    ``workers`` fill torch's threads on the CPU (``serial``; None: when torch's threads are no more than
    ``workers``) and :func:`~resumerge.inputs.kernels.serial_kernels` takes effect."""
    if not (_serial(serial, workers) and torch.device(device).type == "cpu"):
        return False
    with serial_kernels() as single:
        return single


def _serial(serial: bool | None, workers: int) -> bool:
    return torch.get_num_threads() <= workers if serial is None else serial


def _measure_samples(plan: Plan, groups: Sequence[_Sample], sources: InputSources | None, max_bytes: int,
                    max_seconds: float, serial: bool | None, workers: int,
                    resources: Resources = NO_RESOURCES) -> tuple[ComputeGroup, ...]:
    """:func:`measure_compute`'s measuring of ``groups`` (made from ``plan``'s pending tensors), where torch is."""
    if not groups:
        return ()
    serial = _serial(serial, workers)
    device = torch.device(plan.options.device)
    if max_seconds <= 0:
        return tuple(_unmeasured(g, plan, "not measured (switched off)") for g in groups)
    if device.type == "cuda" and not torch.cuda.is_available():
        return tuple(_unmeasured(g, plan, "not measured: no GPU visible here") for g in groups)
    own = sources is None
    reader = InputSources.local(plan.model_dirs) if sources is None else sources
    # Where the run's workers fill torch's threads on the CPU, each computes its tensor on its own thread, that
    # many side by side: the sample times one such thread, as the run computes. (Timed on torch's threads
    # instead, the same sample of DeepSeek-V3's FP8 group took 115-313 ms a call at load 12 against 17-26 ms on
    # one thread: two threads each wait for a core another process holds.)
    alone = serial and device.type == "cpu"
    at_once = max(1, min(workers, torch.get_num_threads())) if alone else 1
    try:
        results = []
        timed: dict[tuple[Any, ...], float] = {}  # whole calls by (function, class): a module's A and B share one
        for index, group in enumerate(groups):
            left = len(groups) - index
            spec = get_method(group.method, plan.units)
            if spec is not None and spec.scaled_probe is not None:
                results.append(_measure_scaled(plan, group, spec, reader, resources, at_once))
            elif spec is not None and spec.whole_cost is not None:
                results.append(_measure_whole(plan, group, spec, reader, alone, at_once, timed))
            else:
                results.append(_measure(plan, group, reader, max_bytes // len(groups), max_seconds / left, alone,
                                            at_once))
            max_seconds = max(0.0, max_seconds - results[-1].measure_seconds)
        return tuple(results)
    finally:
        if own:
            reader.close()


def _groups(plan: Plan, pending: Sequence[ShardPlan], promote: Callable[[tuple[str, ...]], str]) -> list[_Group]:
    """Pending tensors by (method, compute dtype, non-numeric parameters), the group with most elements first.
    ``promote`` names the dtype inputs of several stored dtypes compute in (:func:`_promoted`).

    Tensors that read no input are left out: they are made from the plan alone (zeros, seeded draws, or values
    another process computes, like MoE's routers, whose cost is estimated with that process), not merged."""
    found: dict[tuple[Any, ...], _Group] = {}
    # Looked up once per input dtypes: a 92k-tensor plan has a few.
    stored: dict[tuple[str, ...], str] = {}
    # and the non-numeric parameters once per parameters' tuple (the plan holds it: its id stays its own).
    switches: dict[int, tuple[Any, ...]] = {}
    # NVFP4's group-scale pass: before the first member of a fused group it writes, the engine merges every member
    # once more (its group's largest magnitude measured), written already or not: each is computed again.
    names = [n for s in pending for n in s.tensors]
    again = [m for group in measured_before(plan.tensors, names).values() for m in group]
    for name, measuring in [*((n, False) for n in names), *((m, True) for m in again)]:
        tp = plan.tensors[name]
        if not tp.inputs:
            continue
        dtype = tp.compute_dtype
        if not dtype:
            dtypes = tuple(i.value_dtype for i in tp.inputs)
            dtype = stored.get(dtypes) or stored.setdefault(dtypes, _stored_name(dtypes, promote))
        spec = get_method(tp.method, plan.units)
        if spec is not None and spec.whole_cost is not None:
            # Its class: the input shapes and the parameters that set its cost (not the per-tensor strings).
            values = dict(tp.params)
            flags: tuple[Any, ...] = (tuple(i.shape for i in tp.inputs),
                                      *((k, values.get(k)) for k in spec.whole_cost.params))
        else:
            if id(tp.params) not in switches:
                switches[id(tp.params)] = tuple(sorted((k, v) for k, v in tp.params if isinstance(v, (bool, str))))
            flags = switches[id(tp.params)]
        key = (tp.method, dtype, flags)
        group = found.get(key)
        if group is None:
            group = found[key] = _Group(tp.method, dtype, [], key)
        (group.again if measuring else group.tensors).append(tp)
    return sorted(found.values(), key=lambda g: -g.elements)


def _stored_name(dtypes: tuple[str, ...], promote: Callable[[tuple[str, ...]], str]) -> str:
    """The name of the dtype inputs stored as ``dtypes`` (safetensors names) compute in: theirs when they agree
    (no torch needed), else what ``promote`` says."""
    if len(set(dtypes)) == 1:
        return DTYPE_NAMES[dtypes[0]]
    return promote(dtypes)


def _promoted(dtypes: tuple[str, ...]) -> str:
    """torch's promotion of the stored ``dtypes`` (safetensors names), by name."""
    common = TORCH_DTYPES[dtypes[0]]
    for d in dtypes[1:]:
        common = torch.promote_types(common, TORCH_DTYPES[d])
    return dtype_name(common)


def _unmeasured(group: _Sample, plan: Plan, why: str) -> ComputeGroup:
    return ComputeGroup(group.method, group.dtype, plan.options.device, group.tensors, group.elements,
                        0, 0, None, torch.get_num_threads(), False, why)


def _measure(plan: Plan, group: _Sample, sources: InputSources, max_bytes: int, max_seconds: float,
             alone: bool, at_once: int) -> ComputeGroup:
    """Sample ``group``'s representatives within ``max_bytes`` of input and time the engine's step on them in a
    workspace, as a run's worker computes a whole tensor: its kernels on this thread alone when ``alone`` (the
    run's workers then compute ``at_once`` tensors side by side, one thread each, so the group's wall is the
    timed cost over ``at_once``)."""
    chosen = group.chosen
    if not chosen:
        return _unmeasured(group, plan, "not measured: no tensor with rows to sample")
    spec = get_method(group.method, plan.units)
    assert spec is not None
    started = time.perf_counter()
    per_sample = max_bytes // len(chosen)
    full: list[tuple[int, float]] = []  # (elements, seconds) of each whole sample
    calls: list[float] = []  # per-call overheads fitted from a sample and its leading quarter
    read = 0
    synthetic = False
    workspace = Workspace(UNBUDGETED)  # a few MB here: the sample's rows
    try:
        # Timed by this thread's CPU only where its kernels stay on it (see _timed).
        with serial_kernels() if alone else nullcontext(False) as single:
            for index, tp in enumerate(chosen):
                part = chunk_plan(tp, 0, _rows(tp, per_sample))
                tensors, nbytes, made_up = _prepare(plan, part, sources, spec)
                read += nbytes
                synthetic = synthetic or made_up
                budget = max(0.0, max_seconds - (time.perf_counter() - started)) / (len(chosen) - index)
                window = min(WINDOW_SECONDS, budget / 3) if group.elements >= PRECISE_ELEMENTS else 0.0
                # Each sample is warmed up once on its own: its first call pays what a run pays once, not per
                # element — a compiled encoder's load for its output type (a K-quant's numba kernels: ~1 s, where
                # a Q4_K sample's call takes ms, made a q4_k_m plan say "about 2 min" for 9-14 s), a first read
                # from the disk rather than the page cache (the plan prices the disk's time apart).
                n1, t1 = _timed(plan, part, sources, tensors, workspace, single, True, budget / 2, window)
                full.append((n1, t1))
                quarter = part.shape[0] // 4
                if quarter >= 1 and window > 0:
                    # A call costs a fixed overhead plus a cost per element: waking torch's threads, a read's
                    # system calls, kernel launches on a GPU. A second, smaller sample separates the two, so
                    # tensors of other sizes than the sample's are priced right.
                    head = None if tensors is None else [t[:quarter].contiguous() for t in tensors]
                    n2, t2 = _timed(plan, chunk_plan(part, 0, quarter), sources, head, workspace, single, False,
                                    budget / 2, window)
                    calls.append(max(0.0, min(t1, t1 - (t1 - t2) / (n1 - n2) * n1)) if n1 > n2 and t1 > t2 else 0.0)
                del tensors
    except Exception as exc:  # any failure only means no estimate here; the run reports it properly
        return _unmeasured(group, plan, f"not measured: {group.method} failed on a sample ({type(exc).__name__})")
    per_call = sum(calls) / len(calls) if calls else 0.0
    elements = sum(n for n, _ in full)
    per_element = max(0.0, sum(t - per_call for _, t in full)) / elements if elements else None
    return ComputeGroup(group.method, group.dtype, plan.options.device, group.tensors, group.elements,
                        elements, read, None if per_element is None else per_element / at_once,
                        1 if alone else torch.get_num_threads(), synthetic, "",
                        measure_seconds=time.perf_counter() - started, seconds_per_call=per_call / at_once,
                        at_once=at_once)


def _measure_whole(plan: Plan, group: _Sample, spec: MethodSpec, sources: InputSources, alone: bool, at_once: int,
                   timed: dict[tuple[Any, ...], float]) -> ComputeGroup:
    """One call of the engine's compute step for ``spec`` on synthetic inputs of the shapes of ``group``'s class,
    timed (once for the functions and classes in ``timed``: a module's A and B run one computation) and priced per
    tensor: the call's seconds over the :attr:`~resumerge.merge.methods.spec.WholeCost.shared_by` tensors it serves, and
    over the ``at_once`` workers that run such calls side by side on one thread each (``alone``). Timed by the wall
    clock even then: a decomposition's linear algebra runs on the BLAS library's threads, which serial kernels leave
    alone (3 SVDs of 1024 x 1024 in serial kernels on two threads: 2.8 s of this thread's CPU, 5.5 s of the
    process's), so this thread's CPU would count only its share (the sample is then measured last, with nothing
    beside it)."""
    assert spec.whole_cost is not None
    tp = group.first
    key = (spec.fn, group.key[1:])
    started = time.perf_counter()
    seconds = timed.get(key)
    device = torch.device(plan.options.device)
    if seconds is None:
        try:
            inputs = synthetic_inputs(tp, device, grams=spec.gram_inputs)
            with serial_kernels() if alone else nullcontext():
                _settle(device)
                begun = time.perf_counter()
                _engine_step(plan, tp, sources, inputs, workspace=Workspace(UNBUDGETED), read=False)
                seconds = time.perf_counter() - begun
            del inputs
        except Exception as exc:  # any failure only means no estimate here; the run reports it properly
            return _unmeasured(group, plan, f"not measured: {group.method} failed on a sample ({type(exc).__name__})")
        timed[key] = seconds
    return ComputeGroup(group.method, group.dtype, plan.options.device, group.tensors, group.elements,
                        sum(numel(i.shape) for i in tp.inputs), 0, 0.0, 1 if alone else torch.get_num_threads(),
                        True, spec.whole_cost.bound, measure_seconds=time.perf_counter() - started,
                        seconds_per_call=seconds / spec.whole_cost.shared_by / at_once, whole=True, at_once=at_once)


def _measure_scaled(plan: Plan, group: _Sample, spec: MethodSpec, sources: InputSources, resources: Resources,
                    at_once: int) -> ComputeGroup:
    """The unit of ``group``'s first tensor run whole on its real inputs at the two reduced scales its
    :class:`~resumerge.merge.methods.spec.ScaledProbe` gives (the run's ``resources`` reduced), the small one first once
    more to warm the page cache (the plan prices the disk apart), and extrapolated to the full scale. Timed by the
    wall clock: the unit's linear algebra runs on torch's threads, as the run's does (a transplant's unit is
    thread-dependent: it computes on the run's -j threads)."""
    assert spec.scaled_probe is not None
    tp = group.first
    started = time.perf_counter()
    try:
        probe = spec.scaled_probe(resources, dict(tp.params))

        def call(reduced: Resources) -> float:
            unit = TensorCompute(plan, tp, sources, reduced)
            begun = time.perf_counter()
            unit.merged(0, unit.total)
            _settle(torch.device(plan.options.device))
            return time.perf_counter() - begun

        call(probe.small)
        small = call(probe.small)
        large = call(probe.large)
    except Exception as exc:  # any failure only means no estimate here; the run reports it properly
        return _unmeasured(group, plan, f"not measured: {group.method} failed on a sample ({type(exc).__name__})")
    seconds = small + max(0.0, large - small) * probe.scale
    return ComputeGroup(group.method, group.dtype, plan.options.device, group.tensors, group.elements,
                        sum(numel(i.shape) for i in tp.inputs), sum(_ref_bytes(i) for i in tp.inputs), 0.0,
                        torch.get_num_threads(), False, f"at a reduced scale ({probe.what}, scaled up)",
                        measure_seconds=time.perf_counter() - started, seconds_per_call=seconds / at_once, whole=True,
                        at_once=at_once)


def _settle(device: torch.device) -> None:
    """Wait for the GPU's queued work (its kernels run asynchronously: the clock would see only the launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(plan: Plan, tp: TensorPlan, sources: InputSources, inputs: list[torch.Tensor] | None,
           workspace: Workspace, single: bool, warmup: bool, max_seconds: float,
           window: float) -> tuple[int, float]:
    """(output elements, seconds) of the fastest call of the engine's compute step for ``tp`` (leading rows of a
    tensor) with its resolved parameters, on ``inputs`` (in memory already) or, when None, on its inputs read
    and decoded in each call (see :func:`_engine_step`). A call whose kernels run on this thread alone
    (``single``: :func:`~resumerge.inputs.kernels.serial_kernels` took effect) is timed by this thread's CPU time:
    what it costs a worker that has a core, whatever else the machine is doing while ``plan`` measures (the wall
    time of the same calls at load 7 spread 2.7-fold between samples). Elsewhere by the wall clock: kernels on
    torch's threads would have this thread's CPU count only its share of them."""
    timing = Timing(warmup=warmup, max_seconds=max_seconds, min_seconds=window,
                    clock=time.thread_time if single else time.perf_counter)
    rate = measure_rate(plan.method_of(tp), [inputs or []], base_index=tp.base_index,
                        model_params=[dict(p) for p in tp.model_params], params=dict(tp.params), timing=timing,
                        merge=partial(_engine_step, plan, tp, sources, workspace=workspace, read=inputs is None))
    return rate.sample_elements, rate.seconds_per_element * rate.sample_elements


def _engine_step(plan: Plan, tp: TensorPlan, sources: InputSources, inputs: Sequence[torch.Tensor], *,
                 workspace: Workspace, read: bool) -> int:
    """What the engine computes for ``tp`` (the leading rows of a tensor) as one chunk in ``workspace``, as a run's
    worker computes a whole tensor (:meth:`~resumerge.merge.engine.compute.TensorCompute.rows`): the method lent its
    result buffer, then the output codec's encode (block FP8 and INT4 re-quantize; a plain one casts, or copies
    the result out of the workspace); a fused
    expert stack's sampled experts merged one by one, each with its own generator. With ``read``, the inputs are
    read and decoded into the workspace's buffers here (quantized inputs: the run decodes every one it merges; their
    bytes are in the page cache after a warm-up, and the plan prices the disk's time apart); else ``inputs`` hold
    them already read and prepared. Returns the output elements."""
    rows = chunk_plan(tp, 0, tp.shape[0])
    if rows.experts is not None:  # the experts sampled, not the stack's
        rows = replace(rows, experts=replace(rows.experts, count=rows.shape[0]))
    spec = plan.method_of(tp)

    def load(part: TensorPlan) -> MergeContext:
        if read:
            return load_context(plan, part, sources, spec, NO_RESOURCES, workspace)
        first = part.inputs[0].first_row - rows.inputs[0].first_row  # an expert's rows, or all of them
        if first == 0 and part.shape[0] == tp.shape[0]:  # the whole tensor: inputs of other shapes (Grams) whole
            return make_context(plan, part, spec, list(inputs), NO_RESOURCES, lend=workspace.take)
        return make_context(plan, part, spec, [t[first : first + part.shape[0]] for t in inputs], NO_RESOURCES,
                            lend=workspace.take)

    unit = TensorCompute(plan, rows, sources, NO_RESOURCES, load=load)
    merged = unit.merged(0, unit.total, workspace)
    for stored in rows.out_codec.sampled().encode(merged, rows.out_dtype).values():
        if workspace.holds(stored):  # a result stored as computed: the run copies it out of the workspace
            stored.clone()
    _settle(torch.device(plan.options.device))
    return numel(rows.shape)


def _rows(tp: TensorPlan, max_bytes: int) -> int:
    """Leading rows of ``tp`` to sample: within ``max_bytes`` of stored input and the timing sample size."""
    rows = tp.shape[0]
    row_elements = max(1, numel(tp.shape) // max(1, rows))
    row_bytes = max(1, sum((i.end - i.start) // max(1, i.shape[0]) for i in tp.inputs if i.shape))
    fit = min(max_bytes // row_bytes, DEFAULT_SAMPLE_ELEMENTS // row_elements)
    return max(_MIN_ROWS, min(rows, fit))


def _prepare(plan: Plan, tp: TensorPlan, sources: InputSources,
             spec: MethodSpec) -> tuple[list[torch.Tensor] | None, int, bool]:
    """The inputs of ``tp`` as ``spec`` sees them, on the plan's device, or None where the timed step must read them
    itself (a quantized input: its decode is a cost per element of the run's); the bytes read and whether they
    are synthetic (when any input file is not on disk).

    Read by :func:`~resumerge.merge.engine.compute.load_context`, the engine's own read (LoRA deltas merged, ``dtype:``
    applied, mixed dtypes promoted), so what is timed is what the run computes on.
    """
    if not all(_on_disk(plan, ref) for ref in tp.inputs):
        return synthetic_inputs(tp, torch.device(plan.options.device), grams=spec.gram_inputs), 0, True
    nbytes = sum(_ref_bytes(ref) for ref in tp.inputs)
    if not all(ref.codec.plain for ref in tp.inputs):
        return None, nbytes, False
    return list(load_context(plan, tp, sources, spec, NO_RESOURCES).tensors), nbytes, False  # only the inputs are read


def _ref_bytes(ref: InputRef) -> int:
    lora = (ref.lora.a.end - ref.lora.a.start + ref.lora.b.end - ref.lora.b.start) if ref.lora else 0
    return ref.end - ref.start + lora


def _on_disk(plan: Plan, ref: InputRef) -> bool:
    refs: Iterable[InputRef] = (ref, ref.lora.a, ref.lora.b) if ref.lora is not None else (ref,)
    return all((Path(plan.model_dirs[r.model]) / r.file).is_file() for r in refs)
