"""The suite's collection as one worker pays it: ``python -m pytest --collect-only -q -n 0 [PATHS]`` in a child
process, its wall and CPU seconds (user + system, the child and what it waited for), best of ``--runs``.

    PYTHONPATH=$PWD python bench/suite_collect.py [--runs N] [PATHS ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def collect(paths: list[str]) -> tuple[float, float]:
    """One collection's wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *paths], check=True,
                   stdout=subprocess.DEVNULL, env=os.environ)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("paths", nargs="*", help="what to collect (default: the whole suite)")
    args = parser.parse_args()
    runs = [collect(args.paths) for _ in range(args.runs)]
    for wall, cpu in runs:
        print(f"collection: {wall:.1f} s wall, {cpu:.1f} CPU s")
    print(f"best: {min(cpu for _, cpu in runs):.1f} CPU s (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
