"""The fixed CPU cost of one ``resumerge.api.run`` on a tiny model: two tiny llama models (tests/census.py's
``make_census_model``), a 0.5/0.5 linear merge, run in-process; the first run (imports, first-use caches) is not
counted, then ``--runs`` runs each into a fresh OUT and state dir, timed with ``time.process_time``.

Usage::

    python bench/bench_tiny_run.py [--runs 20] [--profile N] [--keep DIR]

``--profile N`` prints cProfile's N top functions by cumulative time over the counted runs; ``--keep DIR`` builds
the models and runs under DIR (kept) instead of a temp dir, so two checkouts can ``cmp`` their outputs.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    import yaml
    from census import make_census_model

    from resumerge import api

    root = args.keep or Path(tempfile.mkdtemp(prefix="tinyrun"))
    a, b = make_census_model(root / "a", "llama", 1), make_census_model(root / "b", "llama", 2)
    config = yaml.safe_dump({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]},
        sort_keys=False)

    def one(name: str) -> float:
        start = time.process_time()
        api.run(config, root / name / "out", settings=api.Settings(state_dir=root / name / "state"))
        return time.process_time() - start

    one("warm")
    profiler = cProfile.Profile(time.process_time) if args.profile else None
    if profiler:
        profiler.enable()
    cpus = [one(f"run{i}") for i in range(args.runs)]
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    print(f"runs {len(cpus)}  cpu per run: median {statistics.median(cpus) * 1000:.1f} ms, "
          f"min {min(cpus) * 1000:.1f} ms, mean {statistics.mean(cpus) * 1000:.1f} ms  ({root})")


if __name__ == "__main__":
    main()
