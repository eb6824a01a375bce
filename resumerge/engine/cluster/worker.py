"""One output shard computed on a cluster node: the engine's own pipeline, its file handed back to the driver.

A task gets a :class:`ShardTask` (a plan fragment: which shard, the temp path to write it to, the run's thread
count and budgets) and the frozen plan; it reads the shard's inputs itself, runs
:func:`~resumerge.engine.executor.compute_shards` for that shard alone, and returns a :class:`ShardDone` with the
written file's size and digest. It publishes nothing and journals nothing: the driver publishes the temp file
through the run's sink and records it, as the local executor does with its writer's files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from resumerge.engine.devices import gpu_governor, make_governor, set_torch_threads
from resumerge.engine.executor import CONCURRENCY, compute_shards
from resumerge.engine.quiet import NullReporter, never_stop
from resumerge.inputs.source import InputSources
from resumerge.methods.resources import Resources
from resumerge.plan.merge_plan import Plan
from resumerge.store.durable import discard, temp_path
from resumerge.store.sink import LocalDirSink, Receipt


@dataclass(frozen=True)
class ShardTask:
    """What a task needs besides the plan: the shard, the folder its temp file goes to (the run's shared OUT or
    staging folder; each attempt names its own file there, so a retry never meets a lost attempt's), the thread
    count every node computes with (the bytes of some methods depend on it), and the run's budgets (None: the
    node's own default)."""

    shard: str
    folder: str
    threads: int
    max_memory: int | None = None
    max_gpu_memory: int | None = None


@dataclass(frozen=True)
class ShardDone:
    """A shard written by a task: its temp file, size and sha256, its tensors in data order, how long it took,
    and which node made it (filled in by the driver's task wrapper)."""

    shard: str
    temp: str
    size: int
    sha256: str
    tensors: tuple[str, ...]
    seconds: float
    node: str = ""


class _HandOver(LocalDirSink):
    """The task's sink: the shard goes to the temp path the driver chose, and "publishing" it only hands it back
    (the driver publishes it through the run's real sink)."""

    def __init__(self, temp: Path) -> None:
        super().__init__(temp.parent)
        self.temp = temp

    def temp_for(self, name: str) -> Path:
        return self.temp

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        return Receipt.committed(name)


class _Written:
    """The task's journal: keeps what the writer recorded of its one shard."""

    def __init__(self) -> None:
        self.row: tuple[int, str, tuple[str, ...]] | None = None

    def record(self, receipt: Receipt, size: int, sha256: str, *, seconds: float = 0.0,
               tensors: tuple[str, ...] = (), manifest_point: bool = True) -> None:
        self.row = (size, sha256, tensors)

    def settle(self, *, strict: bool = True) -> None:
        """Nothing waits: the driver commits."""


def compute_shard(task: ShardTask, plan: Plan, resources: Resources) -> ShardDone:
    """Compute and write the shard ``task`` names of ``plan`` to its temp path; returns its digests. Raises what the
    local executor would raise for it (a bad input found late, a full disk), after deleting the temp file."""
    started = time.monotonic()
    set_torch_threads(task.threads)
    temp = temp_path(Path(task.folder) / task.shard)
    done = {shard.name for shard in plan.shards if shard.name != task.shard}
    governor = make_governor(plan, task.max_memory)
    gpu = gpu_governor(plan, plan.options.device, task.max_gpu_memory)
    written = _Written()
    governor.start()
    if gpu is not None:
        gpu.start()
    try:
        with InputSources.local(plan.model_dirs) as sources:
            finished = compute_shards(plan, sources, _HandOver(temp), written, NullReporter(), done,
                                      should_stop=never_stop, workers=CONCURRENCY, governor=governor, gpu=gpu,
                                      transfers=False, resources=resources)
    except BaseException:
        discard(temp)
        raise
    finally:
        governor.stop()
        if gpu is not None:
            gpu.stop()
    if not finished or written.row is None:
        discard(temp)
        raise RuntimeError(f"internal: the task for {task.shard} ended without writing it")
    size, sha256, tensors = written.row
    return ShardDone(task.shard, str(temp), size, sha256, tensors, time.monotonic() - started)
