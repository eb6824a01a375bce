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

May import: errors, machine (its names imported on their first use, as torch is).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from resumerge.machine.torch_import import on_first_use

if TYPE_CHECKING:
    from resumerge.machine.memory.accounting import Usage
    from resumerge.machine.memory.budget import (
        DEFAULT_FRACTION,
        SAFETY_MARGIN,
        budget_fitting,
        default_budget,
        pass_budget,
        smallest_budget_for,
        working_room,
    )
    from resumerge.machine.memory.cgroup import CgroupSnapshot, read_snapshot
    from resumerge.machine.memory.collector import collector_paused
    from resumerge.machine.memory.cuda import CudaProbe
    from resumerge.machine.memory.fake import FakeProbe
    from resumerge.machine.memory.governor import MemoryGovernor, Pacing, Reservation
    from resumerge.machine.memory.pressure import Knobs, PressurePolicy
    from resumerge.machine.memory.probe import MemoryProbe, SystemProbe, os_peak_rss, usable_cores
    from resumerge.machine.memory.records import Adaptation, released_on_error
    from resumerge.machine.memory.sizes import format_size, parse_size

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
    "Adaptation": "resumerge.machine.memory.records",
    "CgroupSnapshot": "resumerge.machine.memory.cgroup",
    "CudaProbe": "resumerge.machine.memory.cuda",
    "collector_paused": "resumerge.machine.memory.collector",
    "DEFAULT_FRACTION": "resumerge.machine.memory.budget",
    "FakeProbe": "resumerge.machine.memory.fake",
    "Knobs": "resumerge.machine.memory.pressure",
    "MemoryGovernor": "resumerge.machine.memory.governor",
    "MemoryProbe": "resumerge.machine.memory.probe",
    "Pacing": "resumerge.machine.memory.governor",
    "PressurePolicy": "resumerge.machine.memory.pressure",
    "Reservation": "resumerge.machine.memory.governor",
    "SAFETY_MARGIN": "resumerge.machine.memory.budget",
    "SystemProbe": "resumerge.machine.memory.probe",
    "Usage": "resumerge.machine.memory.accounting",
    "budget_fitting": "resumerge.machine.memory.budget",
    "default_budget": "resumerge.machine.memory.budget",
    "format_size": "resumerge.machine.memory.sizes",
    "os_peak_rss": "resumerge.machine.memory.probe",
    "parse_size": "resumerge.machine.memory.sizes",
    "pass_budget": "resumerge.machine.memory.budget",
    "read_snapshot": "resumerge.machine.memory.cgroup",
    "released_on_error": "resumerge.machine.memory.records",
    "smallest_budget_for": "resumerge.machine.memory.budget",
    "usable_cores": "resumerge.machine.memory.probe",
    "working_room": "resumerge.machine.memory.budget",
})


__getattr__ = on_first_use(__name__, _HOME)
