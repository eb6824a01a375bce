"""``resumerge plan`` of DeepSeek-V3 x R1 (or Kimi-K2 x itself) from headers alone: wall, CPU and peak RSS.

Usage::

    python bench/bench_plan_scale.py [--layout deepseek-v3|kimi-k2] [--mtp] [--twin] [--runs N] [--work DIR]
                                     [--tree DIR ...] [--max-memory SIZE] [--dtype bfloat16]

Writes the sparse real-shape checkpoints of ``tests/sparse_checkpoints.py`` (headers, then a hole: 689 GB for
DeepSeek-V3 cost a few MB of disk) into ``--work`` (two folders: the base and the second model standing in for R1:
the same tensors, names, shapes, dtypes, data offsets and index, but every shard's header in other bytes, entries in
another order and its own metadata, so nothing is shared by the headers' bytes; with ``--twin`` a link to the base's
folder instead, byte-identical headers: the best case for sharing), a linear merge config over them, and times
``resumerge plan CONFIG OUT --json`` run from each ``--tree`` (a checkout of resumerge: compare main's with a
branch's; default this one) ``--runs`` times, alternating: wall seconds, the process's user+system CPU seconds (less
sensitive to a loaded machine than the wall) and its peak RSS, the same two for its helper process (torch's import
and the speed sample), then the plan's own figures (output bytes, shards, RAM estimate, compute groups).
``--mtp`` keeps DeepSeek-V3's MTP layer 61 (refused by a planner that does not know it). ``--hub`` serves the two
folders from the stand-in hub of ``tests/hub`` (in this process, on 127.0.0.1, the LFS tier, no link limit) as
``deepseek-ai/v3`` and ``deepseek-ai/r1`` and plans the config naming those repos, each run with an empty HF cache:
the plan of a user who has downloaded nothing (headers read by range).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests")]

from hub.fakehub import FakeHub, sparse_files_of  # noqa: E402
from sparse_checkpoints import DEEPSEEK_V3, KIMI_K2, write_sparse_checkpoint  # noqa: E402

# Runs `resumerge ARGS` in this process, then prints its CPU seconds and peak RSS on a last line, and those of its
# child processes (plan's helper that imports torch and times the speed sample: its CPU seconds and peak RSS).
_MEASURED = ("import resource, sys\nfrom resumerge.cli.commands import main\ntry:\n    main(sys.argv[1:])\n"
             "except SystemExit:\n    pass\nu = resource.getrusage(resource.RUSAGE_SELF)\n"
             "c = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
             "print('measured', u.ru_utime + u.ru_stime, u.ru_maxrss * 1024, c.ru_utime + c.ru_stime, "
             "c.ru_maxrss * 1024)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("deepseek-v3", "kimi-k2"), default="deepseek-v3")
    parser.add_argument("--mtp", action="store_true", help="keep DeepSeek-V3's MTP layer 61")
    parser.add_argument("--twin", action="store_true",
                        help="the second model is the first's folder under another name (byte-identical headers)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="where the sparse checkpoints go [a temp dir]")
    parser.add_argument("--tree", action="append", type=Path, default=None,
                        help="a resumerge checkout to run plan from (repeatable) [this one]")
    parser.add_argument("--max-memory", default=None, help="passed to plan")
    parser.add_argument("--dtype", default=None, help="the config's dtype [none: the inputs' own]")
    parser.add_argument("--hub", action="store_true", help="plan the two models as repos of the stand-in hub")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="plan-scale-"))
    layout = DEEPSEEK_V3 if args.layout == "deepseek-v3" else KIMI_K2
    started = time.perf_counter()
    base = write_sparse_checkpoint(work / f"{args.layout}-a", layout, mtp=args.mtp)
    if args.twin:
        other = work / f"{args.layout}-b"
        if not other.exists():
            other.symlink_to(base, target_is_directory=True)
    else:
        other = write_sparse_checkpoint(work / f"{args.layout}-b-distinct", layout, mtp=args.mtp, distinct=True)
    print(f"generated {base} and {other.name} in {time.perf_counter() - started:.1f} s")
    names = ("deepseek-ai/v3", "deepseek-ai/r1") if args.hub else (str(base), str(other))
    doc: dict[str, object] = {"merge_method": "linear", "models": [
        {"model": name, "parameters": {"weight": 0.5}} for name in names]}
    if args.dtype:
        doc["dtype"] = args.dtype
    config = work / "merge.yml"
    config.write_text(json.dumps(doc))  # JSON is YAML
    command = ["plan", str(config), str(work / "out"), "--json", "--probe-size", "0",
               "--state-dir", str(work / "state"), *(["--max-memory", args.max_memory] if args.max_memory else [])]
    trees = args.tree or [ROOT]
    hub_env: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if args.hub:
            hub = stack.enter_context(FakeHub())
            hub.push(names[0], sparse_files_of(base))
            hub.push(names[1], sparse_files_of(other))
            hub_env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(work / "hf"), "HF_HUB_DISABLE_XET": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        _timed(args.runs, trees, command, work, hub_env, hub if args.hub else None)


def _timed(runs: int, trees: list[Path], command: list[str], work: Path, hub_env: dict[str, str],
           hub: FakeHub | None) -> None:
    for run in range(runs):
        for tree in trees:
            env = {k: v for k, v in os.environ.items() if not (hub_env and k.startswith(("HF_", "HUGGING")))}
            env |= hub_env | {"PYTHONPATH": str(tree)}
            if hub_env:  # each run a user who has read nothing yet
                shutil.rmtree(work / "hf", ignore_errors=True)
                shutil.rmtree(work / "state", ignore_errors=True)
            if hub is not None:
                hub.reset_counters()
            begun = time.perf_counter()
            # Run from --work: `python -c` puts the working directory first on sys.path, before PYTHONPATH.
            done = subprocess.run([sys.executable, "-c", _MEASURED, *command], capture_output=True, text=True,
                                  env=env, check=False, cwd=work)
            wall = time.perf_counter() - begun
            *lines, last = done.stdout.strip().splitlines() or [""]
            if not last.startswith("measured"):
                print(f"{tree}: failed\n{done.stderr[-3000:]}")
                continue
            cpu, peak, helper_cpu, helper_peak = (float(v) for v in last.split()[1:5])
            print(f"run {run + 1} {tree}: wall {wall:.1f} s, cpu {cpu:.1f} s, peak RSS {peak / 1e9:.2f} GB; "
                  f"helper cpu {helper_cpu:.1f} s, peak RSS {helper_peak / 1e9:.2f} GB; "
                  f"load {os.getloadavg()[0]:.1f}")
            if hub is not None:
                print(f"  hub: {len(hub.requests)} requests, {sum(hub.served.values()) / 1e6:.1f} MB served")
            if run == 0:
                _summary(json.loads("\n".join(lines)))


def _summary(report: dict[str, object]) -> None:
    memory = report["memory"]
    assert isinstance(memory, dict)
    print(f"  output {report['output_bytes']} bytes in {len(report['shards'])} shards "  # type: ignore[arg-type]
          f"({report['shard_size']['why']}); RAM estimate peak {memory['peak_bytes'] / 1e9:.2f} GB "  # type: ignore[index]
          f"(largest unit {memory['largest_unit_bytes'] / 1e9:.2f} GB) under {memory['budget'] / 1e9:.1f} GB")
    for note in report["time"]["notes"]:  # type: ignore[index]
        print(f"  {note}")


if __name__ == "__main__":
    main()
