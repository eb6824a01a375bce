"""Where the suite's CPU goes: the per-test CPU log of a run (tests/conftest.py, RESUMERGE_TEST_CPULOG) summed by
test file, and the costliest tests. CPU seconds, not wall: a run on a loaded machine gives the same figures.

Usage::

    RESUMERGE_TEST_CPULOG=/tmp/cpu.jsonl python -m pytest tests/...
    python bench/suite_cpu.py /tmp/cpu.jsonl --top 30

Each test's figure is its worker's own CPU plus what the worker reaped and what its fork servers' commands used,
from its setup to its teardown (a module-scoped fixture counts in the tests that built it and tore it down).
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
    for line in args.log.read_text().splitlines():
        row = json.loads(line)
        tests[row["test"]] = tests.get(row["test"], 0.0) + row["self"] + row["children"] + row["forked"]
        for part in ("self", "children", "forked"):
            parts[part] += row[part]
    files: dict[str, float] = defaultdict(float)
    for test, seconds in tests.items():
        files[test.split("::", 1)[0]] += seconds
    total = sum(tests.values())
    print(f"{len(tests)} tests, {total:.0f} CPU s (the workers {parts['self']:.0f}, reaped processes "
          f"{parts['children']:.0f}, forked commands {parts['forked']:.0f})")
    print("\nfiles:")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f} %  {name}")
    print("\ntests:")
    for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f} s  {name}")


if __name__ == "__main__":
    main()
