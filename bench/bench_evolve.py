"""One generation of ``resumerge evolve`` scored in one streamed pass against the same candidates each merged to
disk and scored alone (the loop mergekit-evolve runs on a CPU: per candidate a merge written, loaded, evaluated).

Usage::

    PYTHONPATH=TREE python bench/bench_evolve.py [--layers 6 --hidden 768 --intermediate 2048 --vocab 16000]
        [--popsize 8] [--runs 2]

Makes three generated Llama-style float32 models (base, a, b) under the temp dir once and a ``kl`` task's texts,
then alternates, each step a fresh process (its wall time from its start): ``streamed`` is
``resumerge evolve CONFIG STORAGE --popsize P --max-fevals P-1`` (one generation: each candidate a merge never
written, every candidate's layer merged from one read of the parents' layer); ``written`` is the same search with
each candidate merged by ``run`` into STORAGE and scored by check's pass over the written merge
(``resumerge.api.evolution.evolve_into(..., written=True)``). Both tables must hold the same figures to 1e-6.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRITTEN = """
import sys
from pathlib import Path
from resumerge import api
from resumerge.api.evolution import evolve_into
from resumerge.evolve.search import SearchOptions
popsize = int(sys.argv[3])
evolve_into(sys.argv[1], Path(sys.argv[2]), SearchOptions(popsize - 1, popsize), resources=api.Resources(),
            merge_best=None, allow_benchmark_tasks=False, run=api.run, plan_merge=api.plan_merge,
            open_population=api.open_population, evaluate=api.evaluate, written=True)
"""


def _setup(work: Path, args: argparse.Namespace) -> Path:
    import yaml

    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab,
                     heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 256), shard_bytes=1 << 30)
    for seed, name in enumerate(("base", "a", "b"), start=1):
        if not (work / name / "config.json").is_file():
            make_model(work / name, spec, seed=seed)
    texts = work / "texts.txt"
    texts.write_text("".join(f"the {i} cat sat on the mat and looked at the {i + 1} dogs\n" for i in range(8)))
    config = work / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"models": [str(work / "a"), str(work / "b")], "merge_method": "ties",
                   "base_model": str(work / "base"), "layer_granularity": 0},
        "tasks": [{"kl": {"parent": str(work / "a"), "texts": str(texts)}}]}))
    return config


def _timed(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--popsize", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.gettempdir()) / f"bench-evolve-{args.layers}x{args.hidden}"
    work.mkdir(exist_ok=True)
    config = _setup(work, args)
    found: dict[str, list[float]] = {"streamed": [], "written": []}
    tables = {}
    for run in range(args.runs):
        for name in ("streamed", "written"):
            store = work / f"store-{name}"
            shutil.rmtree(store, ignore_errors=True)
            argv = [sys.executable, "-m", "resumerge", "evolve", str(config), str(store), "--popsize",
                    str(args.popsize), "--max-fevals", str(args.popsize - 1)] if name == "streamed" else \
                [sys.executable, "-c", WRITTEN, str(config), str(store), str(args.popsize)]
            wall = _timed(argv)
            found[name].append(wall)
            tables[name] = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]
            print(f"run {run + 1} {name}: {wall:.1f} s", flush=True)
    for ours, theirs in zip(tables["streamed"], tables["written"], strict=True):
        for task, value in theirs["tasks"].items():
            assert abs(ours["tasks"][task] - value) <= 1e-6 * max(abs(value), 1e-3), (task, ours, theirs)
    best = {name: min(times) for name, times in found.items()}
    print(json.dumps({"popsize": args.popsize, "best_s": best, "ratio": best["streamed"] / best["written"],
                      "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
