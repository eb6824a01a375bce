"""How a node's worker computes with the CPUs it declares to Ray: torch's threads and the engine's units at once.

Ray's ``num_cpus`` is a logical resource: nothing stops a worker from running more threads than it declared, and
the engine's pipeline computes :data:`~resumerge.merge.engine.executor.CONCURRENCY` units at once, each on torch's
threads (one thread each where the units fill torch's threads: :mod:`resumerge.inputs.kernels`). A worker that
took the driver's thread count (its ``-j``, or its own machine's cores) therefore ran up to twice that many
threads on however few CPUs it declared: a one-CPU node's worker computed on two threads, and an 8-CPU node's,
under a 16-core driver, on 32. :func:`node_cores` fits both numbers to the declared CPUs instead.

The output's bytes never depend on the choice. For most methods they depend on neither number (their sums run in
a fixed order: :mod:`resumerge.merge.methods.summation`). The methods whose bytes depend on torch's thread count
(``MethodSpec.thread_dependent``: slerp, nuslerp, karcher, model_stock, LoRA extraction's factors) keep the run's
count on every node, and the units at once are chosen so that the pipeline's choice of serial kernels (torch's
threads at most the units at once) is the one a local run makes with that count: a whole-tensor sum's bits
depend on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from resumerge.merge.engine.executor import CONCURRENCY


@dataclass(frozen=True)
class Cores:
    """What a worker computes with: torch's intra-op ``threads`` and the pipeline's ``units`` at once."""

    threads: int
    units: int


def node_cores(recorded: int, cpus: int, *, thread_dependent: bool) -> Cores:
    """Torch's threads and the units at once of a worker that declared ``cpus`` CPUs (at least 1), in a run of
    ``recorded`` threads (its ``-j``, or the driver's torch default); ``thread_dependent``: the bytes of the run's
    methods depend on torch's thread count.

    Where they do not, the worker's threads at work are its ``cpus``: up to :data:`CONCURRENCY` CPUs, one
    single-threaded unit per CPU (as a local run on that many cores); more, as many units as each get more than
    :data:`CONCURRENCY` threads (so that their kernels run in parallel), else one unit on them all. Where they do,
    torch keeps ``recorded`` threads and the units are the fewest that keep the local run's serial choice, more
    only while the CPUs hold them; a node with fewer CPUs than that count is then overcommitted, as the bytes
    require.
    """
    cpus = max(1, cpus)
    if thread_dependent:
        if recorded <= CONCURRENCY:  # serial units, one thread each: at least ``recorded`` of them
            return Cores(recorded, max(recorded, min(CONCURRENCY, cpus)))
        return Cores(recorded, CONCURRENCY if cpus >= CONCURRENCY * recorded else 1)
    if cpus <= CONCURRENCY:
        return Cores(cpus, cpus)
    units = CONCURRENCY if cpus // CONCURRENCY > CONCURRENCY else 1
    return Cores(cpus // units, units)
