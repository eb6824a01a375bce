"""The CPU share of the engine's compute threads in a run whose bytes cross the network.

A run that downloads its inputs or uploads its output waits for the link, and a link is kept busy by threads that
need the CPU now and then (receiving and hashing the downloads, sending the uploads), while the merge waits for
their bytes and has time to spare when its methods are elementwise (a few passes over memory). On a machine with
few cores the merge's threads (and the writer's) take the CPU from them just when a burst of bytes has landed, and
the link idles. So in such a run the compute threads lower their own scheduling priority by :data:`COMPUTE_NICE`:
when the CPU is short, the transfers go first and the merge gets the rest; when it is not, nothing changes.
Measured hub to hub at 150/75 MB/s on the 2-core bench (bench/RESULTS.md, session 17), linear, 5 runs each: the
last input byte landed 1.0 s sooner and the run ended 1.0 s sooner (medians, 28.3 s against 29.3 s). A TIES
merge is what bounds that run on two cores: yielding, its downloads ended 3-8 s sooner and its merge as much
later, so other methods keep the priority (:func:`resumerge.merge.engine.executor.compute_shards` decides).

Linux gives each thread its own nice value, and a thread starts with its creator's: a thread that moves bytes
must therefore never be started by a compute thread (see :class:`resumerge.inputs.hub.landing.Downloads`; a run
that reads some input by HTTP Range, whose threads start from a reader's, keeps every priority). An unprivileged
process cannot raise a priority again, so only threads that end with the run lower theirs; the process's one
hashing thread (:mod:`resumerge.merge.store.shardwriter`), which outlives runs, is started by the run's own thread
first.

May import only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

COMPUTE_NICE = 10
_MOST_NICE = 19


def yield_to_transfers() -> None:
    """Lower the calling thread's scheduling priority by :data:`COMPUTE_NICE` (at most to 19). Nothing where a
    thread has no nice value of its own (not Linux) or the system refuses."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox that forbids it: the run is as before
        os.setpriority(os.PRIO_PROCESS, tid, min(_MOST_NICE, os.getpriority(os.PRIO_PROCESS, tid) + COMPUTE_NICE))
