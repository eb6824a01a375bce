"""A 90k-tensor first ``run`` and a ``resume`` after a kill, trees alternated: wall, CPU, the time from start to the
first unit's read and what the main thread does before it (issue 72, after the proof moved into the units' reads).

Usage::

    python bench/many_first_run.py --config CFG --work DIR --tree A --tree B [--pairs 2] [--no-kill]

``CFG`` is ``tests/manylayers.py``'s config over its two 10,000-layer models (90,003 tensors; build it once, it takes
minutes). Each round runs, per tree (A B, then B A): a first ``run CFG OUT --out-shard-size 1M`` with a fresh OUT
and state dir, then (unless ``--no-kill``) a second first run SIGKILLed once half its shards are committed and its
``resume``. Each command is a fresh ``python -P`` process with the tree on ``PYTHONPATH``, running this file as
``--child``: the CLI's own ``main`` with a few steps wrapped (never changed) to timestamp them, and a thread sampling
the main thread's stack every 5 ms until the first input read. Reported per command: wall and CPU (user + system,
from the parent's rusage), the time from the process's start to the first input read, the main thread's CPU and
the process's CPU by then, the named steps on the main thread (start, end from the process start, thread CPU), the
CPU of the proof's hashing jobs, and the main thread's samples before the first read by resumerge function
(innermost resumerge frame). The load average is printed beside each command: it counts other sessions' niced work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SHARD = "1M"


def _main_cpu() -> float:
    """The main thread's user + system CPU seconds (from /proc: callable from any thread)."""
    tid = threading.main_thread().native_id
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(argv: list[str], report: Path) -> int:
    """Run ``resumerge ARGV`` in this process with its steps timestamped; write what was seen to ``report``."""
    events: list[tuple[str, str, float, float]] = []  # (step, "enter"/"exit", monotonic, main thread CPU)
    firsts: dict[str, tuple[float, float, float]] = {}  # first call: monotonic, main CPU, process CPU
    proof_cpu: list[float] = []
    samples: collections.Counter[str] = collections.Counter()
    outer: collections.Counter[str] = collections.Counter()
    seen_first = threading.Event()
    main_ident = threading.main_thread().ident

    def on_main() -> bool:
        return threading.get_ident() == main_ident

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            main = on_main()
            if main:
                events.append((label, "enter", time.monotonic(), time.thread_time()))
            try:
                return inner(*args, **kwargs)
            finally:
                if main:
                    events.append((label, "exit", time.monotonic(), time.thread_time()))

        setattr(owner, name, wrapped)

    def first(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if label not in firsts:
                firsts[label] = (time.monotonic(), _main_cpu(), time.process_time())
                if label == "first read":
                    seen_first.set()
            return inner(*args, **kwargs)

        setattr(owner, name, wrapped)

    from resumerge.cli.commands import main as resumerge_main
    from resumerge.inputs import contents
    from resumerge.inputs.source import InputSources
    try:
        from resumerge.merge.engine import drive, executor, inputcontents, session
        from resumerge.merge.plan import fetching, workorder
    except ImportError:  # a tree of the layout before the re-layout (5cb55a4, the baseline of issue 87 item 15)
        from resumerge.engine import drive, executor, inputcontents, session  # type: ignore[no-redef]
        from resumerge.plan import fetching, workorder  # type: ignore[no-redef]

    first(InputSources, "read", "first read")
    first(executor, "compute_shards", "pipeline")
    wrap(session, "prepare", "prepare (plan)")
    wrap(drive, "open_run", "open_run")
    wrap(drive, "reconcile", "reconcile")
    wrap(inputcontents.InputContents, "__init__", "InputContents()")
    wrap(inputcontents.InputContents, "record_beside", "record_beside")
    wrap(inputcontents.InputContents, "record", "record")
    for module, name in ((inputcontents, "read_ranges"), (inputcontents, "read_spans"),
                         (inputcontents, "compute_order"), (inputcontents, "read_order"), (executor, "read_order"),
                         (executor, "compute_order")):
        wrap(module, name, f"{module.__name__.rsplit('.', 1)[1]}.{name}")
    if hasattr(inputcontents, "ReadDigests"):
        wrap(inputcontents, "ReadDigests", "ReadDigests()")
    del fetching, workorder
    hash_job = contents._hash

    def timed_hash(job: Any) -> Any:
        start = time.thread_time()
        try:
            return hash_job(job)
        finally:
            proof_cpu.append(time.thread_time() - start)

    contents._hash = timed_hash

    def sample() -> None:
        last = time.monotonic()
        while not seen_first.wait(0.005):
            frame = sys._current_frames().get(main_ident)  # type: ignore[arg-type]
            now = time.monotonic()
            step, last = now - last, now
            inner = top = None
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("resumerge"):
                    where = f"{module.removeprefix('resumerge.')}:{frame.f_code.co_name}"
                    inner = inner or where
                    if module not in ("resumerge.cli.commands", "resumerge.api.calls", "resumerge.api.runkind"):
                        top = where
                frame = frame.f_back
            samples[inner or "(outside resumerge)"] += step
            outer[top or "(outside resumerge)"] += step

    threading.Thread(target=sample, daemon=True).start()
    code = 1
    try:
        code = resumerge_main(argv)
    finally:
        seen_first.set()
        report.write_text(json.dumps({"events": events, "firsts": firsts, "proof_cpu": proof_cpu,
                                      "samples": samples.most_common(14), "outer": outer.most_common(8),
                                      "end": time.monotonic(), "cpu": time.process_time()}))
    return code


def spawn(tree: Path, argv: list[str], report: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, "-P", __file__, "--child", str(report), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def measured(tree: Path, argv: list[str], report: Path) -> dict[str, Any]:
    """One command to its end: wall, CPU, and the child's report."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = spawn(tree, argv, report)
    _, err = proc.communicate()
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:2]} on {tree} failed ({proc.returncode}): {err.decode()[-2000:]}")
    got = json.loads(report.read_text())
    got.update(wall=wall, process_cpu=after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
               spawned=start)
    return got


def done_shards(ledger: Path) -> tuple[int, int]:
    """(committed, all) shards in ``ledger`` (read-only; (0, 0) while it has none)."""
    try:
        with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=0.1) as db:
            rows = db.execute("SELECT status FROM files WHERE kind = 'shard'").fetchall()
    except sqlite3.Error:
        return 0, 0
    return sum(r[0] == "done" for r in rows), len(rows)


def killed(tree: Path, argv: list[str], report: Path, ledger: Path) -> float:
    """Run ``argv`` and SIGKILL it once half its shards are committed; its wall to the kill."""
    start = time.monotonic()
    proc = spawn(tree, argv, report)
    while proc.poll() is None:
        done, total = done_shards(ledger) if ledger.exists() else (0, 0)
        if total and 2 * done >= total:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the run to kill ended by itself ({proc.returncode})")
    return time.monotonic() - start


def show(label: str, tree: Path, got: dict[str, Any], load: float) -> None:
    t0 = got["spawned"]
    read = got["firsts"].get("first read")
    first = f"{read[0] - t0:.2f} s (main thread {read[1]:.2f} CPU s, process {read[2]:.2f})" if read else "none"
    print(f"{label} {tree.name}: wall {got['wall']:.2f} s, CPU {got['process_cpu']:.2f} s, first read at {first}, "
          f"proof jobs {sum(got['proof_cpu']):.2f} CPU s, load {load:.2f}")
    opened: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {}
    for step, what, at, cpu in got["events"]:
        if what == "enter":
            opened[step] = [at, cpu]
        elif step in opened:
            at0, cpu0 = opened.pop(step)
            total = totals.setdefault(step, [at0 - t0, 0.0, 0.0, 0])
            total[1] += at - at0
            total[2] += cpu - cpu0
            total[3] += 1
    print("  main-thread steps (first start s, wall s, CPU s, calls): " + "; ".join(
        f"{step} {v[0]:.2f}, {v[1]:.2f}, {v[2]:.2f}, {v[3]}" for step, v in totals.items()))
    print("  main thread before the first read, by innermost resumerge function (s): " + "; ".join(
        f"{where} {s:.2f}" for where, s in got["samples"]))
    print("  ... by outermost resumerge step (s): " + "; ".join(f"{where} {s:.2f}" for where, s in got["outer"]))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[3:], Path(sys.argv[2])))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tree", type=Path, action="append", required=True)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--no-kill", action="store_true")
    parser.add_argument("--keep", type=Path, help="move the first tree's first finished OUT and state dir here")
    parser.add_argument("--warm", type=Path, help="a small config each tree runs once first, untimed (a new tree "
                        "measures its memory baseline once, then keeps it in a cache)")
    args = parser.parse_args()
    work = args.work
    for tree in args.tree if args.warm is not None else ():
        for path in (work / "warm", work / "warm-state"):
            shutil.rmtree(path, ignore_errors=True)
        measured(tree, ["run", str(args.warm), str(work / "warm"), "--state-dir", str(work / "warm-state"),
                        "--quiet"], work / "report.json")
    for pair in range(args.pairs):
        for tree in args.tree if pair % 2 == 0 else args.tree[::-1]:
            out, state = work / "out", work / "state"
            for path in (out, state):
                shutil.rmtree(path, ignore_errors=True)
            common = ["--state-dir", str(state), "--out-shard-size", SHARD, "--quiet"]
            load = os.getloadavg()[0]
            got = measured(tree, ["run", str(args.config), str(out), *common], work / "report.json")
            show(f"pair {pair} run", tree, got, load)
            if args.keep is not None and tree == args.tree[0] and not args.keep.exists():
                args.keep.mkdir(parents=True)
                out.rename(args.keep / "out")
                state.rename(args.keep / "state")
            for path in (out, state):
                shutil.rmtree(path, ignore_errors=True)
            if args.no_kill:
                continue
            load = os.getloadavg()[0]
            ledger = _ledger_path(tree, out, state)
            at = killed(tree, ["run", str(args.config), str(out), *common], work / "killed.json", ledger)
            got = measured(tree, ["resume", str(out), "--state-dir", str(state), "--quiet"], work / "report.json")
            print(f"pair {pair} killed {tree.name} at {at:.2f} s (load {load:.2f})")
            show(f"pair {pair} resume", tree, got, os.getloadavg()[0])
            for path in (out, state):
                shutil.rmtree(path, ignore_errors=True)
            sys.stdout.flush()


def _ledger_path(tree: Path, out: Path, state: Path) -> Path:
    """Where ``tree``'s resumerge keeps the ledger of a run into ``out`` under ``state``."""
    code = ("import sys; from pathlib import Path; from resumerge.config.locations import run_dir; "
            "print(run_dir(Path(sys.argv[1]), Path(sys.argv[2])) / 'ledger.db')")
    found = subprocess.run([sys.executable, "-P", "-c", code, str(out), str(state)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    return Path(found.stdout.strip())


if __name__ == "__main__":
    main()
