"""One ``resumerge run`` in this process, its CPU by thread and by phase, sampled from ``/proc/self/task`` (issue 95:
where a GGUF release's merge phase leaves a core idle).

Usage::

    PYTHONPATH=$PWD python -P bench/release_threads.py [--json FILE] [--every 0.25] -- CONFIG OUT run-options...

e.g. the 7-type release of bench_gguf_peer's merge (its ``--work`` folder)::

    PYTHONPATH=$PWD python -P bench/release_threads.py -- /tmp/bench-gguf-peer/linear.yml /tmp/rt/out \\
        --state-dir /tmp/rt/state -q --out-type gguf --gguf-type q8_0,q6_k,q5_k_m,q4_k_m,iq4_xs,iq3_m,iq2_m \\
        --imatrix-texts /tmp/bench-gguf-peer/calibration.txt

(OUT and the state dir are emptied first.) With ``--units`` the JSON also holds each unit's events
(bench/run_timeline.py's); ``--replay FILE`` then replays its groups, each with its measured thread CPU, on 2 idle
cores under the engine's line of groups in flight (resumerge.merge.engine.inflight) at 2, 3 and 4 groups per worker:
what the order of work costs on a quiet machine, read from a run on a loaded one.

A sampler thread reads every thread's user + system ticks
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


def unit_groups(events: list[list[Any]]) -> list[tuple[list[str], float]]:
    """The pipeline's groups in order, each its tensors and their thread CPU (run_timeline's events: a group's
    admission names its first tensor; each tensor's rows with their thread CPU)."""
    opened: dict[tuple[str, str], list[Any]] = {}
    cpu: dict[str, float] = {}
    for e in events:
        if e[2] == "rows":
            opened[e[1], e[3]] = e
        elif e[2] == "rows_end":
            first = opened.pop((e[1], e[3]))
            cpu[e[3]] = cpu.get(e[3], 0.0) + e[-1] - first[-1]
    modes = [e for e in events if e[2] == "mode"]
    begun = min(e[0] for e in modes)
    heads = {e[3] for e in events if e[2] == "admit" and e[0] >= begun}
    groups: list[list[str]] = []
    for e in modes:
        if e[3] in heads or not groups:
            groups.append([e[3]])
        else:
            groups[-1].append(e[3])
    return [(group, sum(cpu.get(name, 0.0) for name in group)) for group in groups]


def replay(costs: list[float], workers: int, held: int) -> float:
    """The seconds ``costs`` (each group's CPU, in order) take on ``workers`` idle cores under the engine's line
    (resumerge.merge.engine.inflight): a group starts when fewer than ``workers`` compute and fewer than ``held`` x
    ``workers`` are in the line; groups leave it oldest first, each once it and every older one finished (the writer
    taken as instant)."""
    finish: list[float] = []
    line: list[int] = []
    now = 0.0
    while len(finish) < len(costs) or line:
        line = [i for n, i in enumerate(line) if not all(finish[j] <= now for j in line[:n + 1])]
        working = sum(1 for i in line if finish[i] > now)
        if len(finish) < len(costs) and working < workers and len(line) < held * workers:
            finish.append(now + costs[len(finish)])
            line.append(len(finish) - 1)
            continue
        if not line:
            break
        now = min(finish[i] for i in line if finish[i] > now) if working else max(finish[i] for i in line)
    return max(finish, default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--units", action="store_true",
                        help="also record each unit's events (bench/run_timeline.py's: mode, rows, admission, "
                             "hand-over, writes, each with its thread CPU) into --json")
    parser.add_argument("--replay", type=Path, help="no run: replay the groups of a --units JSON on 2 idle cores "
                        "under the line's limit of 2, 3 and 4 groups per worker, and print the seconds")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- CONFIG OUT run-options...")
    args = parser.parse_args()
    if args.replay is not None:
        groups = unit_groups(json.loads(args.replay.read_text())["units"])
        costs = [cost for _, cost in groups]
        print(f"{len(groups)} groups, {sum(costs):.2f} thread CPU s (over 2 cores: {sum(costs) / 2:.2f} s); on 2 "
              "workers: " + ", ".join(f"{held} per worker {replay(costs, 2, held):.2f} s" for held in (2, 3, 4)))
        return 0
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
