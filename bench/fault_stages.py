"""One ``resumerge run`` in this process, each thread's CPU and minor faults split by the engine stage it was in.

Usage: ``python bench/fault_stages.py CONFIG OUT [run options...]``, e.g. bench_quant's kept case or bench_linear's
float32 merge::

    python bench/fault_stages.py bench/work/quant/linear.yml /tmp/out --state-dir /tmp/state --quiet
    python bench/fault_stages.py bench/work/linear.yml /tmp/out --state-dir /tmp/state --quiet

Wraps the engine's steps (never changes them) and charges each thread's user and system CPU and minor faults
(``getrusage(RUSAGE_THREAD)``) to the innermost step it is in: the reads of input bytes, the block-FP8 decode and
encode, the rest of the context's preparation (casts), the method, the result's copy out of the workspace, the
writer. The kernel's zero-fill of fresh pages shows as system time in the step that first touches them (a fault
counts once per page: a 2 MiB transparent huge page is one). Figures from a shared machine are its load's.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import threading
import time
from typing import Any

# As the CLI's entry sets it (before torch is imported): buffers of 2 MiB and more as transparent huge pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

TOTALS: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
_LOCAL = threading.local()


def _now() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _charge(stage: str, since: tuple[float, float, int]) -> None:
    user, system, faults = _now()
    total = TOTALS[stage]
    total[0] += user - since[0]
    total[1] += system - since[1]
    total[2] += faults - since[2]


def wrap(owner: Any, name: str, stage: str) -> None:
    """Charge what ``owner.name`` spends, less the wrapped steps it calls, to ``stage``."""
    inner = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        stack = _LOCAL.__dict__.setdefault("stack", [])
        if stack:  # the enclosing step pauses
            _charge(stack[-1][0], stack[-1][1])
        stack.append([stage, _now()])
        try:
            return inner(*args, **kwargs)
        finally:
            _charge(stage, stack.pop()[1])
            if stack:
                stack[-1][1] = _now()

    setattr(owner, name, wrapped)


def main() -> None:
    from resumerge.cli.commands import main as cli
    from resumerge.inputs import tensorio
    from resumerge.inputs.codecs import fp8_block
    from resumerge.merge.engine import compute
    from resumerge.merge.store import shardwriter

    wrap(compute.TensorCompute, "whole", "unit (other)")
    wrap(compute.TensorCompute, "merged", "method")
    wrap(compute, "load_context", "context (casts, other)")
    wrap(tensorio.TensorReader, "read", "read")
    wrap(fp8_block.BlockFp8Codec, "decode", "decode fp8")
    wrap(fp8_block.BlockFp8Codec, "encode", "encode fp8")
    wrap(compute, "_finish", "finish (cast, copy out)")
    wrap(shardwriter.ShardWriter, "write", "writer")
    wrap(shardwriter.ShardWriter, "finish", "writer finish")
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    try:
        cli(["run", *sys.argv[1:]])
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(f"wall {time.monotonic() - start:.2f} s  process user {after.ru_utime - before.ru_utime:.2f} s  "
              f"sys {after.ru_stime - before.ru_stime:.2f} s  minor faults {after.ru_minflt - before.ru_minflt}  "
              f"load {os.getloadavg()[0]:.1f}")
        for stage, (user, system, faults) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0] - kv[1][1]):
            print(f"  {stage:26s} user {user:6.2f} s  sys {system:6.2f} s  minor faults {int(faults):8d}")


if __name__ == "__main__":
    main()
