"""The RAM part of ``plan``'s estimate: the budget, the merge's working set unit by unit, and tensors too large for it.

Every pending tensor's unit is sized as the engine will size it (:mod:`resumerge.merge.plan.workunits`), once per class
of tensors (:class:`~resumerge.merge.plan.unitkey.TensorClasses`, sorted once for both): a 92k-tensor plan holds a few
dozen classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from resumerge.analyses.estimate.costs import MemoryEstimate
from resumerge.machine.memory import SAFETY_MARGIN, MemoryProbe, default_budget, format_size, working_room
from resumerge.merge.engine.footprint import run_baseline, smallest_run_budget
from resumerge.merge.engine.unitgroup import group_bytes, has_room, joins_others
from resumerge.merge.plan.fusedscales import measured_before
from resumerge.merge.plan.merge_plan import Plan, TensorPlan
from resumerge.merge.plan.unitkey import TensorClasses
from resumerge.merge.plan.workunits import (
    ROWS,
    WHOLE,
    collects_sibling,
    estimate_bytes,
    held_bytes,
    streamed_bytes,
    unit_bytes,
    unit_mode,
)

if TYPE_CHECKING:
    from resumerge.analyses.estimate.torchside import TorchFacts

__all__ = ["memory_estimate", "working_set"]


def memory_estimate(plan: Plan, pending: Sequence[Any], probe: MemoryProbe, max_memory: int | None, workers: int,
                    remote: AbstractSet[tuple[str, str]], held: TorchFacts) -> tuple[MemoryEstimate, list[str]]:
    """The memory the merge of ``pending`` shards of ``plan`` needs under ``max_memory`` (None: the default budget)
    on the machine ``probe`` reads, with ``workers`` compute workers, ``remote`` the (model, file) pairs streamed
    from the hub; and why it cannot run (empty: it fits, as far as single units go). The budget counts the run's
    whole process: its baseline is :func:`~resumerge.merge.engine.footprint.run_baseline`'s, not this process's.
    ``held`` says what a helper holding torch keeps from ``probe``'s available memory, and torch's thread count."""
    # A helper's own memory (torch's included) is free again before the run: the run's process finds it available.
    budget = max_memory if max_memory is not None else default_budget(probe, freed=held.helper_bytes)
    source = "--max-memory" if max_memory is not None else "default"
    limit = probe.limit()
    machine = probe.rss() + probe.available() + held.helper_bytes
    machine = min(machine, limit) if limit is not None else machine
    effective = min(budget, machine)
    # The run's process, not this one: a fresh run's baseline (measured once per installation) and what it adds,
    # as the run's own guard counts it (resumerge.merge.engine.devices.make_governor), so both name one smallest budget.
    baseline = run_baseline(plan)
    room = max(0, effective - int(effective * SAFETY_MARGIN) - baseline)
    classes = TensorClasses(plan.tensors.values())
    # The engine sizes its units by what the budget leaves beside the baseline (MemoryGovernor.work_budget).
    units = pending_units(plan, pending, working_room(budget, baseline), remote, serial=held.threads <= workers,
                          classes=classes, threads=held.threads)
    working = working_set(units, room, workers)
    largest = max((u for u, _ in units), default=0)
    reasons = []
    worst = smallest_run_budget(plan, baseline, classes=classes, threads=held.threads)
    if worst.needed > effective:
        what = f"tensor {worst.tensor} ({worst.method})" if worst.tensor else "the merge's process"
        if worst.needed > machine:
            reasons.append(
                f"memory: {what} needs a budget of {format_size(worst.needed)}, but this machine can give the merge "
                f"at most {format_size(machine)}: merge on a machine with more memory"
            )
        else:
            reasons.append(
                f"memory: {what} needs a budget of {format_size(worst.needed)}, more than {format_size(effective)}: "
                f"rerun with --max-memory {format_size(worst.needed, compact=True)} or more"
            )
    return (MemoryEstimate(budget, source, machine, baseline, baseline, working, largest, worst.needed), reasons)


def pending_units(plan: Plan, pending: Sequence[Any], budget: int,
                  remote: AbstractSet[tuple[str, str]] = frozenset(), *, serial: bool = True,
                  classes: TensorClasses | None = None, threads: int | None = None) -> list[tuple[int, bool]]:
    """(estimate, streamed in row chunks) of every unit the engine admits for the pending tensors, in its order.

    The engine's own rule (:func:`~resumerge.merge.plan.workunits.unit_mode`) decides: a tensor streamed to the writer
    in row chunks counts its whole estimate (the chunks together fill the room), one computed in passes over
    chunks counts a chunk and its output, any other its whole estimate; a unit that collects its sibling's result
    (:func:`~resumerge.merge.plan.workunits.collects_sibling`) joins its sibling's, as the engine counts it; consecutive
    whole tensors of one shard that may share a group are one unit of their estimates' sum, as the engine admits
    them (:mod:`~resumerge.merge.engine.unitgroup`). ``remote``
    holds the (model, file) pairs streamed from the hub, which the engine does not read more than once when it has
    a choice; ``serial`` says whether the engine's workers fill torch's threads (see
    :func:`~resumerge.merge.plan.workunits.unit_mode`), ``threads`` torch's thread count there (None: this process's).
    Each class of tensors is sized once (``classes``: the plan's
    tensors sorted, when the caller sorted them already).
    """
    method_of = plan.method_of
    classes = classes if classes is not None else TensorClasses(plan.tensors.values())

    def sized(rereadable: bool) -> Callable[[TensorPlan], tuple[int, bool, bool]]:
        def size(tp: TensorPlan) -> tuple[int, bool, bool]:  # (estimate, in row chunks, may share a group)
            method = method_of(tp)
            mode = unit_mode(tp, method, budget, plan.options.device, rereadable=rereadable, serial=serial,
                             threads=threads)
            if mode == ROWS:
                return streamed_bytes(tp, method, threads=threads), True, False
            shares = joins_others(method, whole=mode == WHOLE, sibling=False)
            return unit_bytes(tp, method, mode, threads=threads), False, shares

        return classes.per_class(size)

    def measuring(tp: TensorPlan) -> int:
        """What the engine admits to merge ``tp`` once more for its fused group's scale (Executor._amax)."""
        method = method_of(tp)
        mode = unit_mode(tp, method, budget, plan.options.device, serial=serial, threads=threads)
        if mode == ROWS:
            return estimate_bytes(tp, method, threads=threads) + held_bytes(tp, method)
        return unit_bytes(tp, method, mode, threads=threads)

    local, streamed = sized(True), sized(False)
    most = group_bytes(budget)
    units: list[tuple[int, bool]] = []
    grouped = 0  # how many units the last one holds, while another may join it (0: none may)
    previous: TensorPlan | None = None
    # NVFP4's group-scale pass: before a fused group's first member, each member merged once more, admitted as
    # its own unit is (whole: a shared-scale format's chunk is all its rows), one after the other
    measured = measured_before(plan.tensors, (n for s in pending for n in s.tensors))
    for shard in pending:
        grouped = 0  # no group spans shards
        for name in shard.tensors:
            tp = plan.tensors[name]
            for member in measured.get(name, ()):
                units.append((measuring(plan.tensors[member]), False))
                grouped = 0
            if units and collects_sibling(previous, tp, method_of(tp)):
                # It collects what its sibling computed, holding its result only, and takes no worker's turn.
                units[-1], grouped = (units[-1][0] + tp.nbytes, units[-1][1]), 0
                previous = tp
                continue
            remote_read = remote and any((ref.model, ref.file) in remote for ref in tp.inputs)
            estimate, chunked, shares = streamed(tp) if remote_read else local(tp)
            if shares and grouped and has_room(grouped, units[-1][0], estimate, most):
                units[-1], grouped = (units[-1][0] + estimate, False), grouped + 1
            else:
                units.append((estimate, chunked))
                grouped = 1 if shares else 0
            previous = tp
    return units


def working_set(units: Sequence[tuple[int, bool]], room: int, workers: int) -> int:
    """The most bytes in flight at once: ``workers`` consecutive whole units, or one chunked tensor, within room.

    A unit is admitted alone even above the room (waiting could not help), so a window never counts less than
    its largest unit; a chunked tensor's chunks together stay within the room.
    """
    best = 0
    window: list[int] = []
    for size, chunked in units:
        if chunked:
            window = []  # the engine hands over everything in flight before streaming a tensor in chunks
            best = max(best, min(size, room) if room > 0 else size)
            continue
        window = [*window, size][-max(1, workers):]
        best = max(best, max(min(sum(window), room), max(window)))
    return best
