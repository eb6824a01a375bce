"""Memory governance: budgets, container limits, admission of work, batch sizes that shrink under pressure.

Typical use by the engine::

    probe = SystemProbe()
    budget = parse_size(args.max_memory, option="--max-memory") if args.max_memory else default_budget(probe)
    if smallest_budget_for(unit_bytes, baseline_bytes=probe.rss()) > budget:  # at plan time
        ...  # refuse, naming that smallest budget
    with MemoryGovernor(budget, probe) as governor:
        with governor.acquire(unit_bytes, what=name):  # a Reservation, released when the block exits
            ...

Importing this package never imports torch.

May import: errors.
"""

from resumerge.memory.accounting import Usage
from resumerge.memory.budget import (
    DEFAULT_FRACTION,
    SAFETY_MARGIN,
    default_budget,
    smallest_budget_for,
)
from resumerge.memory.cgroup import CgroupSnapshot, read_snapshot
from resumerge.memory.cuda import CudaProbe
from resumerge.memory.fake import FakeProbe
from resumerge.memory.governor import MemoryGovernor, Reservation
from resumerge.memory.pressure import Knobs, PressurePolicy
from resumerge.memory.probe import MemoryProbe, SystemProbe, os_peak_rss, usable_cores
from resumerge.memory.records import Adaptation
from resumerge.memory.sizes import format_size, parse_size

__all__ = [
    "DEFAULT_FRACTION",
    "SAFETY_MARGIN",
    "Adaptation",
    "CgroupSnapshot",
    "CudaProbe",
    "FakeProbe",
    "Knobs",
    "MemoryGovernor",
    "MemoryProbe",
    "PressurePolicy",
    "Reservation",
    "SystemProbe",
    "Usage",
    "default_budget",
    "format_size",
    "os_peak_rss",
    "parse_size",
    "read_snapshot",
    "smallest_budget_for",
    "usable_cores",
]
