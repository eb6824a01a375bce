"""Memory governance: budgets, container limits, admission of work, batch sizes that shrink under pressure.

Typical use by the engine::

    probe = SystemProbe()
    budget = parse_size(args.max_memory, option="--max-memory") if args.max_memory else default_budget(probe)
    if smallest_budget_for(unit_bytes, baseline_bytes=probe.rss()) > budget:  # at plan time
        ...  # refuse, naming that smallest budget
    with MemoryGovernor(budget, probe) as governor:
        with governor.acquire(unit_bytes, what=name):  # a Reservation, released when the block exits
            ...

Importing this package never imports torch, and imports each name"s module only at the name"s first use (PEP 562):
``resumerge status`` needs only :mod:`.sizes`, and the governor"s modules bring psutil and ctypes.

May import: errors.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.torch_import import on_first_use

if TYPE_CHECKING:
    from resumerge.memory.accounting import Usage
    from resumerge.memory.budget import (
        DEFAULT_FRACTION,
        SAFETY_MARGIN,
        budget_fitting,
        default_budget,
        pass_budget,
        smallest_budget_for,
        working_room,
    )
    from resumerge.memory.cgroup import CgroupSnapshot, read_snapshot
    from resumerge.memory.collector import collector_paused
    from resumerge.memory.cuda import CudaProbe
    from resumerge.memory.fake import FakeProbe
    from resumerge.memory.governor import MemoryGovernor, Pacing, Reservation
    from resumerge.memory.pressure import Knobs, PressurePolicy
    from resumerge.memory.probe import MemoryProbe, SystemProbe, os_peak_rss, usable_cores
    from resumerge.memory.records import Adaptation, released_on_error
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
    "Pacing",
    "PressurePolicy",
    "Reservation",
    "SystemProbe",
    "Usage",
    "budget_fitting",
    "collector_paused",
    "default_budget",
    "format_size",
    "os_peak_rss",
    "parse_size",
    "pass_budget",
    "read_snapshot",
    "released_on_error",
    "smallest_budget_for",
    "usable_cores",
    "working_room",
]

# Where each public name is defined, imported at its first use.
_HOME = MappingProxyType({
    "Adaptation": "resumerge.memory.records",
    "CgroupSnapshot": "resumerge.memory.cgroup",
    "CudaProbe": "resumerge.memory.cuda",
    "collector_paused": "resumerge.memory.collector",
    "DEFAULT_FRACTION": "resumerge.memory.budget",
    "FakeProbe": "resumerge.memory.fake",
    "Knobs": "resumerge.memory.pressure",
    "MemoryGovernor": "resumerge.memory.governor",
    "MemoryProbe": "resumerge.memory.probe",
    "Pacing": "resumerge.memory.governor",
    "PressurePolicy": "resumerge.memory.pressure",
    "Reservation": "resumerge.memory.governor",
    "SAFETY_MARGIN": "resumerge.memory.budget",
    "SystemProbe": "resumerge.memory.probe",
    "Usage": "resumerge.memory.accounting",
    "budget_fitting": "resumerge.memory.budget",
    "default_budget": "resumerge.memory.budget",
    "format_size": "resumerge.memory.sizes",
    "os_peak_rss": "resumerge.memory.probe",
    "parse_size": "resumerge.memory.sizes",
    "pass_budget": "resumerge.memory.budget",
    "read_snapshot": "resumerge.memory.cgroup",
    "released_on_error": "resumerge.memory.records",
    "smallest_budget_for": "resumerge.memory.budget",
    "usable_cores": "resumerge.memory.probe",
    "working_room": "resumerge.memory.budget",
})


__getattr__ = on_first_use(__name__, _HOME)
