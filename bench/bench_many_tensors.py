"""A run of 90k tiny tensors (issue 45): per-tensor costs, status latency, verify, kill + resume, ledger size, and
mergekit side by side where it finishes.

Usage: ``python bench/bench_many_tensors.py [--layers 10000] [--mergekit-layers 1000] [--work DIR]
[--pythonpath DIR] [--skip-mergekit]``

Generates two Llama-style models of ``--layers`` tiny layers (9 tensors each, 8 wide: ``tests/manylayers.py``, the
tests' generator) once, then, each ``resumerge`` a subprocess (``--pythonpath`` picks the checkout measured, e.g.
/work/main for the "before" figures):

- an uninterrupted ``run`` (1M output shards): wall, CPU (user + system), peak RSS, wall per tensor, ledger bytes
  per tensor;
- ``verify`` of it;
- a second ``run`` SIGKILLed once half its shards are committed, then ``resume``: their walls together against
  the uninterrupted one; meanwhile ``status`` is asked every 2 s from the start (its wall and CPU, and the
  state it answers: "planning" or "no merge recorded" while the run plans);
- at ``--mergekit-layers``: ``mergekit-yaml`` and ``resumerge run`` on the same config, wall and peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# tests/: tests.manylayers imports tests/support.py, which imports its neighbours (forkserver) as top-level modules
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]

from bench_vs_mergekit import run_measured  # noqa: E402

from resumerge.config.locations import run_dir  # noqa: E402
from resumerge.errors import LedgerError  # noqa: E402
from resumerge.merge.store.ledger_read import read_merge_record  # noqa: E402
from tests.manylayers import many_layer_merge  # noqa: E402

SHARD = "1M"  # in mergekit's K/M/B form, which resumerge reads too (mergekit reads a trailing B as billions)


def models(work: Path, layers: int) -> Path:
    """The config over two ``layers``-layer models under ``work`` (generated once)."""
    root = work / f"models-{layers}"
    config = root / "merge.yml"
    if not config.exists():
        many_layer_merge(root, layers)
    return config


def resumerge(*args: str) -> list[str]:
    # -P: the checkout on PYTHONPATH, not the current directory, is the resumerge measured
    return [sys.executable, "-P", "-m", "resumerge", *args]


def status_probe(out: Path, state: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """One ``resumerge status``: (wall s, CPU s, first line)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(resumerge("status", str(out), "--state-dir", str(state)), env=env, capture_output=True,
                          text=True, check=False)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    line = (done.stdout or done.stderr).strip().splitlines()[0] if (done.stdout or done.stderr).strip() else ""
    return wall, cpu, line


def killed_then_resumed(config: Path, work: Path, env: dict[str, str]) -> dict[str, object]:
    """Run, SIGKILL at half the shards, resume; ``status`` every 2 s meanwhile."""
    out, state = work / "killed", work / "killed-state"
    for path in (out, state):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    ledger = run_dir(out, state) / "ledger.db"
    start = time.monotonic()
    proc = subprocess.Popen(resumerge("run", str(config), str(out), "--state-dir", str(state), "--out-shard-size",
                                      SHARD, "--quiet"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probes: list[tuple[float, float, float, str]] = []
    next_probe = start
    while proc.poll() is None:
        now = time.monotonic()
        if now >= next_probe:
            wall, cpu, line = status_probe(out, state, env)
            probes.append((now - start, wall, cpu, line.split(":", 2)[1].strip() if ":" in line else line))
            next_probe = now + 2.0
        record = None
        with contextlib.suppress(LedgerError):
            record = read_merge_record(ledger) if ledger.exists() else None
        shards = [f for f in record.files if f.kind == "shard"] if record is not None else []
        if shards and 2 * sum(f.status == "done" for f in shards) >= len(shards):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    killed = time.monotonic() - start
    resumed = run_measured(resumerge("resume", str(out), "--state-dir", str(state), "--quiet"), env=env)
    return {"killed_wall": killed, "resume_wall": resumed.wall, "resume_rss": resumed.peak_rss, "probes": probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10_000)
    parser.add_argument("--mergekit-layers", type=int, default=1_000)
    parser.add_argument("--work", type=Path, default=HERE / "work" / "many-tensors")
    parser.add_argument("--pythonpath", default=str(ROOT), help="the checkout whose resumerge is measured")
    parser.add_argument("--skip-mergekit", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": args.pythonpath}
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    config = models(work, args.layers)
    tensors = 9 * args.layers + 3
    out, state = work / "out", work / "state"
    for path in (out, state):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = run_measured(resumerge("run", str(config), str(out), "--state-dir", str(state), "--out-shard-size", SHARD,
                                 "--quiet"), env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    ledger_dir = run_dir(out, state)
    ledger_bytes = sum(p.stat().st_size for p in ledger_dir.glob("ledger.db*"))
    verify = run_measured(resumerge("verify", str(out), "--state-dir", str(state)), env=env)
    kr = killed_then_resumed(config, work, env)
    print(f"checkout: {args.pythonpath}; {tensors} tensors ({args.layers} layers), --out-shard-size {SHARD}")
    print("| run wall s | ms per tensor | run CPU s | peak RSS MB | ledger bytes per tensor | verify s | "
          "killed at half s | resume s | kill + resume vs run |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = float(kr["killed_wall"]) + float(kr["resume_wall"])  # type: ignore[arg-type]
    print(f"| {run.wall:.1f} | {1000 * run.wall / tensors:.2f} | {run_cpu:.1f} | {run.peak_rss / 1e6:.0f} | "
          f"{ledger_bytes / tensors:.0f} | {verify.wall:.2f} | {kr['killed_wall']:.1f} | {kr['resume_wall']:.1f} | "
          f"{total / run.wall:.2f}× |")
    probes = kr["probes"]
    assert isinstance(probes, list)
    if probes:
        walls = [p[1] for p in probes]
        cpus = [p[2] for p in probes]
        print(f"status during the run: {len(probes)} calls, wall median {statistics.median(walls):.2f} s, max "
              f"{max(walls):.2f} s; CPU median {statistics.median(cpus):.2f} s, max {max(cpus):.2f} s")
        print("status answers (s since start: state): " + ", ".join(f"{p[0]:.0f}: {p[3]}" for p in probes[:12]))
    if args.skip_mergekit:
        return
    small = models(work, args.mergekit_layers)
    mk_out, rm_out, rm_state = work / "mk-out", work / "rm-out", work / "rm-state"
    for path in (mk_out, rm_out, rm_state):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    exe = shutil.which("mergekit-yaml") or "mergekit-yaml"
    mergekit = run_measured([exe, str(small), str(mk_out), "--random-seed", "0", "--quiet", "--out-shard-size", SHARD],
                            env=env)
    ours = run_measured(resumerge("run", str(small), str(rm_out), "--state-dir", str(rm_state), "--out-shard-size",
                                  SHARD, "--quiet"), env=env)
    print(f"at {9 * args.mergekit_layers + 3} tensors: mergekit {mergekit.wall:.1f} s, "
          f"{mergekit.peak_rss / 1e6:.0f} MB; resumerge {ours.wall:.1f} s, {ours.peak_rss / 1e6:.0f} MB "
          f"({ours.wall / mergekit.wall:.2f}× the wall, {ours.peak_rss / mergekit.peak_rss:.2f}× the RSS)")


if __name__ == "__main__":
    main()
