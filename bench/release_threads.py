"""One ``resumerge run`` in this process, its CPU by thread and by phase, sampled from ``/proc/self/task`` (issue 95:
where a GGUF release's merge phase leaves a core idle).

Usage::

    PYTHONPATH=$PWD python -P bench/release_threads.py [--json FILE] [--every 0.25] -- CONFIG OUT run-options...

e.g. the 7-type release of bench_gguf_peer's merge (its ``--work`` folder)::

    PYTHONPATH=$PWD python -P bench/release_threads.py -- /tmp/bench-gguf-peer/linear.yml /tmp/rt/out \\
        --state-dir /tmp/rt/state -q --out-type gguf --gguf-type q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs,iq3_m,iq2_m \\
        --imatrix-texts /tmp/bench-gguf-peer/calibration.txt

(OUT and the state dir are emptied first.) A sampler thread reads every thread's user + system ticks
(``/proc/self/task/TID/stat``) each ``--every`` seconds and names it by its Python thread (``resumerge-merge_0``
and ``_1`` counted apart; a thread Python did not start, such as torch's or numba's, by its kernel name). After the
run, the ledger's events split the samples into the run's phases (as ``bench_gguf_peer.phases``): for each, its
wall, its CPU seconds and their ratio (the busy cores), the share of its time with the process under 0.5, 0.5 to 1.5
and over 1.5 cores busy, and the CPU seconds of each thread. CPU seconds are the machine's own per thread (ticks of
10 ms), so other sessions' load lengthens the wall but not a thread's CPU: on a shared machine read the CPU
figures and the busy cores as a bound (a thread waiting for a core it could have had counts as idle).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import shutil
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def ticks() -> dict[int, tuple[str, int]]:
    """Each live thread's (kernel name, user + system ticks)."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        found[int(task.name)] = (comm, int(fields[11]) + int(fields[12]))
    return found


def children() -> dict[int, tuple[str, int]]:
    """The CPU ticks of the process's children that ended (``RUSAGE_CHILDREN``: a fresh-process measurement the run
    starts, a memory baseline, is CPU the run pays; counted as it is reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {0: ("children (as they end)", round((usage.ru_utime + usage.ru_stime) * TICK))}


def sample(into: list[tuple[float, dict[str, int]]], names: dict[int, str], stop: threading.Event,
           every: float) -> None:
    """Append (epoch seconds, {thread: cumulative ticks}) every ``every`` seconds until ``stop``."""
    while True:
        for thread in threading.enumerate():
            if thread.native_id is not None:
                names.setdefault(thread.native_id, thread.name)
        now = time.time()
        into.append((now, {f"{names.get(tid, comm)}#{tid}": n
                             for tid, (comm, n) in {**ticks(), **children()}.items()}))
        if stop.wait(every):
            return


def phase_marks(state: Path, began: float, ended: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase the run's ledger under ``state`` recorded, after its start."""
    ledger = next(state.glob("*/ledger.db"))
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        events = db.execute("SELECT at, kind, message FROM events ORDER BY id").fetchall()
    marks = [("start", began), ("recording the plan", events[0][0])]
    marks += [(re.sub(r" \(phase \d+ of \d+\)$", "", message), at) for at, kind, message in events
              if kind == "phase" and re.search(r"\(phase \d+ of \d+\)$", message)]
    done = next((at for at, kind, message in events if kind == "state" and message == "done"), ended)
    return [(name, start, end) for (name, start), (_, end) in zip(marks, [*marks[1:], ("end", done)], strict=True)]


def thread_group(key: str) -> str:
    """A sample's thread key less its id (``resumerge-merge_0#123`` -> ``resumerge-merge_0``)."""
    return key.rsplit("#", 1)[0]


def summary(samples: list[tuple[float, dict[str, int]]], start: float, end: float) -> dict[str, Any]:
    """The samples within [start, end]: wall, CPU, busy cores, the shares of time by busy cores, CPU by thread."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return {"wall": round(end - start, 2), "cpu": None}
    by_thread: dict[str, float] = {}
    shares = [0.0, 0.0, 0.0]
    for (t0, a), (t1, b) in itertools.pairwise(inside):
        step = 0
        for key, n in b.items():
            d = n - a.get(key, 0)  # a thread born since t0: all its ticks
            by_thread[thread_group(key)] = by_thread.get(thread_group(key), 0.0) + d / TICK
            step += d
        cores = step / TICK / (t1 - t0)
        shares[0 if cores < 0.5 else 1 if cores < 1.5 else 2] += t1 - t0
    wall = inside[-1][0] - inside[0][0]
    cpu = sum(by_thread.values())
    return {"wall": round(wall, 2), "cpu": round(cpu, 2), "busy_cores": round(cpu / wall, 2),
            "time_under_0.5_cores": round(shares[0] / wall, 3), "time_0.5_to_1.5": round(shares[1] / wall, 3),
            "time_over_1.5": round(shares[2] / wall, 3),
            "threads": {k: round(v, 2) for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v > 0}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--units", action="store_true",
                        help="also record each unit's events (bench/run_timeline.py's: mode, rows, admission, "
                             "hand-over, writes, each with its thread CPU) into --json")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- CONFIG OUT run-options...")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    out, state = Path(argv[1]), Path(argv[argv.index("--state-dir") + 1])
    for folder in (out, state):
        shutil.rmtree(folder, ignore_errors=True)
    samples: list[tuple[float, dict[str, int]]] = []
    names: dict[int, str] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(samples, names, stop, args.every), name="sampler", daemon=True)
    if args.units:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import run_timeline

        run_timeline.instrument()
    began = time.time()
    sampler.start()
    from resumerge.cli.commands import main as command

    code = command(["run", *argv])
    ended = time.time()
    stop.set()
    sampler.join()
    report = {"code": code, "phases": {name: summary(samples, start, end)
                                       for name, start, end in phase_marks(state, began, ended)}}
    for name, figures in report["phases"].items():
        print(f"{name}: {json.dumps(figures)}", flush=True)
    if args.json is not None:
        units = {}
        if args.units:  # run_timeline's clock is monotonic from its import: its events' epoch is T0's
            units = {"units": run_timeline.EVENTS, "units_epoch": time.time() - time.monotonic() + run_timeline.T0}
        args.json.write_text(json.dumps({**report, "samples": samples, **units}, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
