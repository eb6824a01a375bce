"""The memory budget: its default when ``--max-memory`` is not given, and the smallest budget a unit of work needs
(what plan-time refusals name)."""

from __future__ import annotations

import math

from resumerge.errors import UsageError
from resumerge.machine.memory.probe import MemoryProbe
from resumerge.machine.memory.sizes import format_size

__all__ = [
    "DEFAULT_FRACTION",
    "SAFETY_MARGIN",
    "budget_fitting",
    "default_budget",
    "pass_budget",
    "smallest_budget_for",
    "working_room",
]

# 80 % of what we could get: torchsnapshot budgets 60 % of available (it shares the box with training;
# earlier revisions used 80 %). A merge is the machine's main job, but the rest must absorb glibc heap that is
# freed yet not returned, allocator fragmentation, Python objects, the page cache our reads need, and estimate
# error.
DEFAULT_FRACTION = 0.80

# Admission stops this fraction short of the budget: estimates exclude small temporaries and RSS is sampled,
# so the last few percent are kept for what the estimates cannot see.
SAFETY_MARGIN = 0.05


def default_budget(probe: MemoryProbe, fraction: float = DEFAULT_FRACTION, *, freed: int = 0) -> int:
    """Return ``fraction`` of the memory this process could hold right now.

    "Could hold" is what we hold already plus what is available: ``probe.rss() + probe.available()``, which
    is the ceiling (physical RAM or the container limit, whichever :class:`SystemProbe` found smaller) minus
    what other processes use — memory that is not ours. It is also capped at ``fraction`` of
    ``probe.limit()``. Example: a free Colab VM (12.7 GB, ~1.4 GB used by the VM) gives about 9 GB. ``freed``
    bytes held elsewhere now will be available by the time the budget is used (a helper process that ``plan``
    started and ends before the run: see :mod:`resumerge.analyses.estimate.torchside`).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    ours = probe.rss() + probe.available() + freed
    ceiling = probe.limit()
    if ceiling is not None:
        ours = min(ours, ceiling)
    return int(ours * fraction)


def smallest_budget_for(unit_bytes: int, *, baseline_bytes: int = 0, margin_fraction: float = SAFETY_MARGIN) -> int:
    """Return the smallest budget under which a unit of ``unit_bytes`` fits with nothing else in flight.

    ``baseline_bytes`` is the memory held before the unit starts (interpreter, torch, the write buffer);
    the governor admits while ``baseline + unit`` fits the budget less its safety margin. The result is
    rounded *up* to three significant digits so that :func:`~resumerge.machine.memory.sizes.format_size` prints it
    exactly and the printed figure still works.
    """
    if unit_bytes < 0 or baseline_bytes < 0:
        raise ValueError("sizes must not be negative")
    needed = math.ceil((unit_bytes + baseline_bytes) / (1 - margin_fraction))
    if needed < 1000:
        return needed
    step = int(10 ** (len(str(needed)) - 3))
    return -(-needed // step) * step


def working_room(budget: int, baseline: int, margin_fraction: float = SAFETY_MARGIN) -> int:
    """What ``budget`` leaves for units of work beside ``baseline`` bytes the process holds apart from them, less the
    governor's margin (at least 1): what a merge sizes its units, groups and buffers by (a budget counts the whole
    process, so its quarter is not a quarter of the room its work has)."""
    return max(1, budget - int(budget * margin_fraction) - baseline)


def budget_fitting(what: str, peak: int, max_memory: int | None, probe: MemoryProbe, *,
                   held: int | None = None) -> int:
    """The budget in force (``max_memory``, else the default) for work whose largest step holds ``peak`` bytes
    beyond what this process holds (its whole resident set: the budget counts the process); raises
    :class:`~resumerge.errors.UsageError` (exit 2, before any weight is read) naming the smallest budget that fits
    (:func:`pass_budget`, the figure ``measure --plan`` names too), when that one does not. ``what`` names the work
    ("the check"). ``held``: the process's settled reading
    (:func:`~resumerge.machine.memory.baseline.settled_reading`: what every start of this work names), the one figure
    the budget is judged by; None: ``probe``'s reading now, judged as it is and named with 1 % of it more (a rerun with
    the named budget is not refused again for a reading a little higher)."""
    budget = max_memory if max_memory is not None else default_budget(probe)
    reading = probe.rss()
    judged = held if held is not None else reading
    if smallest_budget_for(peak, baseline_bytes=judged) > budget:
        smallest = pass_budget(peak, held if held is not None else reading + reading // 100)
        raise UsageError(f"{what} needs {format_size(reading + peak)} (this process holds {format_size(reading)}, "
                         f"its largest step {format_size(peak)}), more than the budget of {format_size(budget)}",
                         hint=f"rerun with --max-memory {format_size(smallest, compact=True)} or more")
    return budget


def pass_budget(peak: int, held: int) -> int:
    """The smallest ``--max-memory`` named for work whose largest step holds ``peak`` bytes beside ``held`` bytes its
    process holds apart from it: the one figure ``check``'s and ``measure``'s refusals and ``measure --plan`` name
    (``plan`` and ``run`` name :func:`~resumerge.merge.engine.footprint.smallest_run_budget`'s, of the same rule)."""
    return smallest_budget_for(peak, baseline_bytes=held)
