"""Where the suite's CPU goes: the per-test CPU log of a run (tests/conftest.py, RESUMERGE_TEST_CPULOG) summed by
test file, and the costliest tests. CPU seconds, not wall: a run on a loaded machine gives the same figures.

Usage::

    RESUMERGE_TEST_CPULOG=/tmp/cpu.jsonl python -m pytest tests/...
    python bench/suite_cpu.py /tmp/cpu.jsonl --top 30

Each test's figure is its worker's own CPU plus what the worker reaped and what its fork servers' commands used,
from its setup to its teardown (a module-scoped fixture counts in the tests that built it and tore it down). Where
the log has each test's wall and worker, it also prints each worker's wall and CPU and the tests that waited
longest beyond their CPU: where a whole run's wall goes that its CPU does not explain. Where the log has ``group``
(RESUMERGE_TEST_CGROUP, ``-n 0``: the CPU of every process of the run's cgroup, Ray's raylets and workers included),
that is each test's CPU instead, and the waits are measured against it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the JSON lines RESUMERGE_TEST_CPULOG named")
    parser.add_argument("--top", type=int, default=25, help="how many files and tests to list")
    args = parser.parse_args()
    tests: dict[str, float] = {}
    parts: dict[str, float] = defaultdict(float)
    walls: dict[str, float] = {}
    workers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in args.log.read_text().splitlines():
        row = json.loads(line)
        cpu = row["group"] if "group" in row else row["self"] + row["children"] + row["forked"]
        tests[row["test"]] = tests.get(row["test"], 0.0) + cpu
        if "wall" in row:  # logs written before the wall was kept have none
            walls[row["test"]] = walls.get(row["test"], 0.0) + row["wall"]
            workers[row["worker"]][0] += row["wall"]
            workers[row["worker"]][1] += cpu
        for part in ("self", "children", "forked", "group"):
            parts[part] += row.get(part, 0.0)
    files: dict[str, float] = defaultdict(float)
    for test, seconds in tests.items():
        files[test.split("::", 1)[0]] += seconds
    total = sum(tests.values())
    print(f"{len(tests)} tests, {total:.0f} CPU s (the workers {parts['self']:.0f}, reaped processes "
          f"{parts['children']:.0f}, forked commands {parts['forked']:.0f}"
          + (f"; the cgroup's every process {parts['group']:.0f}" if parts["group"] else "") + ")")
    print("\nfiles:")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f} %  {name}")
    print("\ntests:")
    for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f} s  {name}")
    if walls:
        _waits(tests, walls, workers, args.top)


def _waits(tests: dict[str, float], walls: dict[str, float], workers: dict[str, list[float]], top: int) -> None:
    """Where the wall went that no CPU explains (logs with ``wall``, tests/conftest.py): each worker's wall and CPU,
    and the tests that waited longest beyond their CPU (a test's CPU may run on both cores at once: its children, a
    kernel's threads, so the wait is wall minus CPU, floored at 0)."""
    print("\nworkers (wall of their tests, CPU):")
    for worker, (wall, cpu) in sorted(workers.items()):
        print(f"{wall:8.1f} s wall {cpu:8.1f} s CPU  {worker}")
    waits = {name: max(0.0, walls[name] - tests[name]) for name in walls}
    print(f"\nwaits (wall beyond CPU: {sum(waits.values()):.0f} s in all):")
    for name, seconds in sorted(waits.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{seconds:8.1f} s  {name}  (wall {walls[name]:.1f} s, CPU {tests[name]:.1f} s)")


if __name__ == "__main__":
    main()
