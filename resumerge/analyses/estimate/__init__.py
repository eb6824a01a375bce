"""What a run will cost before it starts: disk, downloads, peak RAM and time, and whether it fits here.

``resumerge plan`` prints the estimate and :func:`resumerge.api.estimate` returns it (:mod:`.estimate`; the result and
its JSON schema in :mod:`.costs`). It reads the plan, samples the engine's own compute path on a few rows
(:mod:`.compute`, :mod:`.method_timing`; on :mod:`.synthetic` inputs where the plan's are not on disk), sizes memory
the way the engine schedules (:mod:`.memory`) and the disks by filesystem (:mod:`.disks`), and probes the link and the
CPU cost of a byte moved (:mod:`.network`, :mod:`.cpuprobe`), with torch kept in a side process when a cheap answer
needs no torch here (:mod:`.torchside`); :mod:`.sessions` turns a session length into hub commits. It sits above the
engine: it may run the engine's pieces to time them, and the engine never asks it anything, so a run's code path is
the same with or without an estimate.

May import: errors, config, machine, merge.methods, inputs, merge.store, merge.plan, outputs, merge.engine.
"""

__all__ = [
    "compute",
    "computegroup",
    "costs",
    "cpuprobe",
    "disks",
    "estimate",
    "firstpass",
    "measuring",
    "memory",
    "method_timing",
    "network",
    "sessions",
    "synthetic",
    "torchside",
]
