"""How much of the suite's 2-worker wall is lost at its end, by test order: a replay of xdist's worksteal.

Usage::

    python -m pytest --collect-only -q -p no:randomly > collected.txt      # the order the suite runs in
    python bench/suite_order.py collected.txt suite.log [--wall 663] [--draws 200]

``suite.log`` is a whole-suite run's output with ``--durations=N``: its N longest tests keep their times, every other
test gets an equal share of what is left of ``2 × (wall - 15 s of collection)``. Each draw scales every time by a
random factor in 0.6-1.4 (a loaded machine, another run) and replays worksteal as pytest-xdist 3.x does: worker 0
takes the first half of the collection, worker 1 the rest, and a worker left with fewer than two queued tests takes
the last half of the other's queue. Prints the idle time at the end (the later worker's finish minus half the work)
for the collection's order, the order tests/conftest.py makes (modules holding a test in ``--slow`` first), and
that order with the tests whose names contain ``--also`` treated as slow too.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from pathlib import Path

DURATION = re.compile(r"\s*([0-9.]+)s (?:call|setup|teardown)\s+(\S+)")


def replay(times: Sequence[float]) -> float:
    """The later worker's finish under worksteal, for tests run in the order of ``times``."""
    queues = [list(range(len(times) // 2)), list(range(len(times) // 2, len(times)))]
    clock = [0.0, 0.0]
    while queues[0] or queues[1]:
        for me in (0, 1):
            other = queues[1 - me]
            take = min(len(other) // 2, len(other) - 2)
            if len(queues[me]) < 2 and take > 0:
                queues[me] += other[-take:]
                del other[-take:]
        worker = min((w for w in (0, 1) if queues[w]), key=lambda w: clock[w])
        clock[worker] += times[queues[worker].pop(0)]
    return max(clock)


def slow_first(names: Sequence[str], slow: set[str]) -> list[int]:
    """Indices of ``names`` with the modules that hold a test in ``slow`` first, as tests/conftest.py orders."""
    modules = {n.split("::")[0] for n in slow}
    return sorted(range(len(names)), key=lambda i: names[i].split("::")[0] not in modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("collected", type=Path)
    parser.add_argument("log", type=Path)
    parser.add_argument("--wall", type=float, default=663.0, help="the logged run's wall [default: 663]")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--slow", nargs="*", default=[], help="substrings naming the slow-marked tests")
    parser.add_argument("--also", nargs="*", default=[], help="substrings naming more tests to treat as slow")
    args = parser.parse_args()
    names = [line.strip() for line in args.collected.read_text().splitlines() if "::" in line]
    known: dict[str, float] = {}
    for match in DURATION.finditer(args.log.read_text()):
        known[match[2]] = known.get(match[2], 0.0) + float(match[1])
    rest = (2 * (args.wall - 15) - sum(known.get(n, 0.0) for n in names)) / max(1, len(names) - len(known))
    times = [known.get(n, rest) for n in names]
    slow = {n for n in names if any(s in n for s in args.slow)}
    more = slow | {n for n in names if any(s in n for s in args.also)}
    orders = {"collection": list(range(len(names))), "slow first": slow_first(names, slow),
              "slow first + also": slow_first(names, more)}
    for label, order in orders.items():
        idle = []
        for draw in range(args.draws):
            rng = random.Random(draw)
            drawn = [t * rng.uniform(0.6, 1.4) for t in times]
            idle.append(replay([drawn[i] for i in order]) - sum(drawn) / 2)
        idle.sort()
        print(f"{label}: idle at the end median {idle[len(idle) // 2]:.1f} s, "
              f"p90 {idle[len(idle) * 9 // 10]:.1f} s, max {idle[-1]:.1f} s")


if __name__ == "__main__":
    main()
