"""One ``resumerge run`` in this process with a timeline of its pipeline: what each budget actually schedules.

Usage: ``python bench/run_timeline.py CONFIG OUT [run options...] [--timeline FILE]``, e.g. bench_quant's models::

    python bench/run_timeline.py bench/work/quant/linear.yml /tmp/out --state-dir /tmp/state --quiet
    python bench/run_timeline.py bench/work/quant/linear.yml /tmp/out1 --state-dir /tmp/state1 --quiet \\
        --max-memory 1GB

Wraps the engine's steps (never changes them) and prints, from the first unit to the last shard's publication:
how each tensor is computed (whole or in row chunks) and its estimate; the time with 0, 1 and 2 units computing;
the waits for admission and for the oldest unit's result; the writer's busy time and the shard's finish; the time
from the last computed rows to the shard's publication (the writer catching up: a quantized shard's codes are
written ahead of its hash frontier and read back); the thread CPU of the units by kind; and, sampled every 50 ms,
peak RSS, minor faults and the bytes read from and written to the disk (``/proc/self/io``). A streamed tensor's chunk
encodings (a quantized GGUF's embeddings and head) count as units; an importance pass's merges (``--imatrix-texts``)
are printed apart, before the pipeline. ``--timeline FILE`` also writes every event and sample as JSON. Figures
from a shared machine are its load's: compare CPU seconds.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

T0 = time.monotonic()
EVENTS: list[tuple[Any, ...]] = []


def rec(*event: Any) -> None:
    EVENTS.append((time.monotonic() - T0, threading.current_thread().name, *event, time.thread_time()))


def wrap(owner: Any, name: str, before: str, after: str, what: Any = lambda *a: ()) -> None:
    """Record ``before`` and ``after`` (with ``what(*args)``) around ``owner.name``."""
    inner = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        rec(before, *what(*args))
        try:
            return inner(*args, **kwargs)
        finally:
            rec(after, *what(*args))

    setattr(owner, name, wrapped)


def instrument() -> None:
    from resumerge.merge.engine import executor, inflight, inputcontents, writer
    from resumerge.merge.plan import workunits
    from resumerge.merge.store import shardwriter

    mode_of = executor.unit_mode

    def unit_mode(tp: Any, method: Any, budget: Any, *args: Any, **kwargs: Any) -> str:
        mode = mode_of(tp, method, budget, *args, **kwargs)
        rec("mode", tp.name, mode, budget, workunits.estimate_bytes(tp, method))
        return mode

    executor.unit_mode = unit_mode  # type: ignore[assignment]
    wrap(executor._Pipeline, "_admit", "admit", "admitted", lambda self, what, *a: (what,))
    wrap(inflight.InFlight, "hand_over_oldest", "hand", "handed", lambda self: ("oldest",))
    wrap(executor.TensorCompute, "rows", "rows", "rows_end", lambda self, first, stop, *a: (self.tp.name, first, stop))
    # A streamed tensor's chunks, merged on the calling thread and encoded on a worker (a quantized GGUF's
    # embeddings and head): each encoding counted as a unit computing.
    if hasattr(executor._Pipeline, "_encode"):  # a static method: wrapped as one
        encode = executor._Pipeline._encode

        def encoded(*args: Any) -> Any:
            rec("rows", "(a streamed chunk's encoding)", 0, 0)
            try:
                return encode(*args)
            finally:
                rec("rows_end", "(a streamed chunk's encoding)", 0, 0)

        executor._Pipeline._encode = staticmethod(encoded)  # type: ignore[method-assign]
    wrap(writer.Writer, "_write", "write", "written", lambda self, shard, names, tensors: (names[0],))
    wrap(shardwriter.ShardWriter, "finish", "finish", "finished", lambda self: (self.name,))
    # The input proof (its hashing threads' CPU shows in the process's, read around it).
    wrap(inputcontents.InputContents, "record", "proof", "proved", lambda *a: (time.process_time(),))
    if hasattr(inputcontents, "Proving"):  # taken beside the merge's first units (a first local run)
        wrap(inputcontents.Proving, "_prove", "proof", "proved", lambda *a: (time.process_time(),))


def sample(samples: list[tuple[float, ...]], stop: threading.Event) -> None:
    while not stop.wait(0.05):
        status = Path("/proc/self/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        samples.append((time.monotonic() - T0, rss << 10, int(stat[7]), int(io["read_bytes"]),
                        int(io["write_bytes"]), (int(stat[11]) + int(stat[12])) / 100))


def spans(start: str, end: str) -> list[tuple[float, float, Any, float]]:
    """(start, end, the event's first field, thread CPU) of each ``start``/``end`` pair on one thread."""
    opened: dict[tuple[str, Any], tuple[Any, ...]] = {}
    found = []
    for event in EVENTS:
        if event[2] == start:
            opened[event[1], event[3]] = event
        elif event[2] == end and (event[1], event[3]) in opened:
            first = opened.pop((event[1], event[3]))
            found.append((first[0], event[0], event[3], event[-1] - first[-1]))
    return found


def report(samples: list[tuple[float, ...]]) -> None:
    modes = collections.Counter((e[4], e[6] >> 20) for e in EVENTS if e[2] == "mode")
    print("units (mode, estimate MiB): count:", dict(sorted(modes.items(), key=lambda kv: -kv[1])))
    modes_at = [e[0] for e in EVENTS if e[2] == "mode"]
    if not modes_at:
        return
    first = min(modes_at)
    # The pipeline's units: not the rows an importance pass (--imatrix-texts) merged before the plan's run began.
    rows = [r for r in spans("rows", "rows_end") if r[0] >= first]
    if not rows:
        return
    before = spans("rows", "rows_end")[: len(spans("rows", "rows_end")) - len(rows)]
    if before:
        print(f"before the pipeline (an importance pass's merges): {len(before)} tensors' rows from {before[0][0]:.2f} "
              f"to {before[-1][1]:.2f} s, {sum(c for _, _, _, c in before):.2f} thread CPU s")
    # A GGUF run publishes no safetensors shard (no ShardWriter.finish): its pipeline ends with its last rows.
    last = max((e[0] for e in EVENTS if e[2] == "finished"), default=max(e for _, e, _, _ in rows))
    busy: collections.Counter[int] = collections.Counter()
    edges = sorted([(s, 1) for s, _, _, _ in rows] + [(e, -1) for _, e, _, _ in rows])
    at, level = first, 0
    for t, step in edges:
        busy[level] += t - at
        at, level = t, level + step
    print(f"pipeline {last - first:.2f} s; seconds with n units computing: "
          + ", ".join(f"{n}: {s:.2f}" for n, s in sorted(busy.items())))
    admit = sum(e - s for s, e, _, _ in spans("admit", "admitted"))
    hand = sum(e - s for s, e, _, _ in spans("hand", "handed"))
    written = spans("write", "written")
    finish = spans("finish", "finished")
    print(f"admission waits {admit:.2f} s, waits for the oldest unit {hand:.2f} s, writer busy "
          f"{sum(e - s for s, e, _, _ in written):.2f} s ({sum(c for _, _, _, c in written):.2f} CPU s), finish "
          f"{sum(e - s for s, e, _, _ in finish):.2f} s, "
          f"last rows computed to shard published {last - max(e for _, e, _, _ in rows):.2f} s")
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for _, _, name, cpu in rows:
        # A layer's tensor by its name in the layer (mlp.up_proj), any other by its own name.
        kinds[name.split(".layers.")[1].split(".", 1)[1].rsplit(".", 1)[0] if ".layers." in name else name].append(cpu)
    print(f"units' thread CPU {sum(c for _, _, _, c in rows):.2f} s; by kind (count, total s): "
          + ", ".join(f"{k} {len(v)} {sum(v):.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))))
    proof = [e for e in EVENTS if e[2] in ("proof", "proved")]
    if len(proof) == 2:
        print(f"start-up to the proof {proof[0][0]:.2f} s ({proof[0][3]:.2f} CPU s), the proof "
              f"{proof[1][0] - proof[0][0]:.2f} s (process CPU meanwhile {proof[1][3] - proof[0][3]:.2f} s), its end "
              f"to the first unit {first - proof[1][0]:.2f} s")
    if samples:
        print(f"peak RSS {max(s[1] for s in samples) / 1e6:.0f} MB, minor faults {samples[-1][2]}, disk read "
              f"{samples[-1][3] / 1e6:.0f} MB, written {samples[-1][4] / 1e6:.0f} MB, process CPU "
              f"{samples[-1][5]:.2f} s")


def main() -> None:
    argv = sys.argv[1:]
    timeline = None
    if "--timeline" in argv:
        at = argv.index("--timeline")
        timeline = Path(argv[at + 1])
        del argv[at : at + 2]
    from resumerge.cli.commands import main as resumerge_main

    instrument()
    samples: list[tuple[float, ...]] = []
    stop = threading.Event()
    threading.Thread(target=sample, args=(samples, stop), daemon=True).start()
    code = resumerge_main(["run", *argv])
    stop.set()
    report(samples)
    if timeline is not None:
        timeline.write_text(json.dumps({"events": EVENTS, "samples": samples}))
    sys.exit(code)


if __name__ == "__main__":
    main()
