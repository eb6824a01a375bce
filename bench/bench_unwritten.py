"""A merge never written against the same merge written and read back, and a generation read in one pass against
its candidates read one by one.

Usage::

    PYTHONPATH=TREE python bench/bench_unwritten.py [--layers 6 --hidden 768 --intermediate 2048 --vocab 16000]
        [--runs 2] [--popsize 4]

Makes three generated Llama-style float32 models (base, a, b) under the temp dir once, then alternates, each step
in a fresh process (its wall time from its start, its own peak RSS, the bytes it wrote):

- ``written``: ``resumerge run`` of a TIES config into OUT, then the forward pass (each text's NLL, one decoder
  layer at a time, :class:`~resumerge.forward.engine.stream.ModelStream`) over the written output;
- ``unwritten``: the same forward pass over :func:`resumerge.api.open_unwritten` of the same config;
- ``one by one``: ``--popsize`` candidates (TIES with other weights and densities) each read unwritten alone;
- ``generation``: the same candidates read in one pass (:func:`resumerge.api.open_population`).

The NLLs of ``written`` and ``unwritten`` must agree to 1e-6, and each candidate's in both generation steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import parents

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # textnll: the texts' NLLs the unwritten-merge tests compare
TEXTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(96)] for i in range(4)]


def _models(work: Path, args: argparse.Namespace) -> list[Path]:
    paths = [work / f"{name}-{args.layers}x{args.hidden}" for name in ("base", "a", "b")]
    parents.made(paths, args)
    return paths


def _config(work: Path, models: list[Path], index: int) -> Path:
    import yaml

    weights = [(0.6, 0.4), (0.3, 0.9), (0.5, 0.5), (0.8, 0.2), (0.2, 0.7), (0.4, 0.4), (0.7, 0.6), (0.9, 0.1)]
    w = weights[index % len(weights)]
    doc = {"merge_method": "ties", "base_model": str(models[0]), "models": [
        {"model": str(models[1]), "parameters": {"weight": w[0], "density": 0.5 + 0.05 * (index % 5)}},
        {"model": str(models[2]), "parameters": {"weight": w[1], "density": 0.7 - 0.05 * (index % 5)}}]}
    path = work / f"candidate{index}.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _written_bytes() -> int:
    with open(f"/proc/{os.getpid()}/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("wchar:"))


def step(name: str, work: Path, configs: list[Path], started: float) -> dict[str, Any]:
    """One measured step, in this (fresh) process."""
    from textnll import population_nlls, stream_nlls

    from resumerge import api
    from resumerge.analyses.check.models import open_checked
    from resumerge.config.locations import StateDir
    from resumerge.forward.engine.reader import Weights

    state = work / "state"
    settings = api.Settings(state_dir=state)
    result: dict[str, Any] = {"step": name}
    if name == "written":
        out = work / f"out-{time.time_ns()}"
        try:
            api.run(configs[0], out, settings=api.Settings(state_dir=state))
            model = open_checked(str(out), "MODEL", StateDir.resolve(state))
            result["nll"] = [stream_nlls(Weights.of(model.opened.directory, model.opened.tensors), model.opened.config,
                                         TEXTS, what="bench")]
        finally:
            shutil.rmtree(out, ignore_errors=True)
    elif name == "unwritten":
        with api.open_unwritten(configs[0], settings) as merge:
            result["nll"] = [stream_nlls(Weights.of(merge.directory, merge.tensors, source=merge.source), merge.config,
                                         TEXTS, what="bench")]
    elif name == "one by one":
        result["nll"] = []
        for config in configs:
            with api.open_unwritten(config, settings) as merge:
                result["nll"].append(stream_nlls(Weights.of(merge.directory, merge.tensors, source=merge.source),
                                                 merge.config, TEXTS, what="bench"))
    else:
        with api.open_population(configs, settings) as population:
            result["nll"] = population_nlls(population, TEXTS, what="bench")
            result["read MB"] = population.shared.bytes_read / 1e6
            result["kept MB"] = population.shared.peak_kept / 1e6
    result["wall s"] = time.time() - started
    result["peak RSS MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["written MB"] = _written_bytes() / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parents.add_shape(parser)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--popsize", type=int, default=4)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(tempfile.gettempdir()) / "resumerge-bench-unwritten"
    work.mkdir(exist_ok=True)
    models = _models(work, args)
    configs = [_config(work, models, i) for i in range(args.popsize)]
    if args.step is not None:
        chosen = configs[:1] if args.step in ("written", "unwritten") else configs
        print(json.dumps(step(args.step, work, chosen, args.started)))
        return
    size = sum(f.stat().st_size for f in models[0].glob("*.safetensors")) / 1e6
    print(f"models: 3 x {size:.0f} MB; popsize {args.popsize}; load {os.getloadavg()}")
    rows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        for name in ("written", "unwritten", "one by one", "generation"):
            flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("step", "started")]
            done = subprocess.run([sys.executable, __file__, *flags, "--step", name, "--started", str(time.time())],
                                  capture_output=True, text=True, check=True, env={**os.environ})
            rows.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    for name, results in rows.items():
        walls = sorted(r["wall s"] for r in results)
        extra = {k: round(v, 1) for k, v in results[-1].items() if k in ("read MB", "kept MB")}
        print(f"| {name} | {walls[len(walls) // 2]:.2f} ({', '.join(f'{w:.2f}' for w in walls)}) | "
              f"{max(r['peak RSS MB'] for r in results):.0f} | {results[-1]['written MB']:.0f} | {extra} |")
    want, got = rows["written"][-1]["nll"][0], rows["unwritten"][-1]["nll"][0]
    print("written = unwritten NLL to 1e-6:", all(abs(x - y) <= 1e-6 for x, y in zip(want, got, strict=True)))
    one, generation = rows["one by one"][-1]["nll"], rows["generation"][-1]["nll"]
    print("generation = one by one NLL to 1e-6:", all(abs(x - y) <= 1e-6 for a, b in zip(one, generation, strict=True)
                                                     for x, y in zip(a, b, strict=True)))


if __name__ == "__main__":
    main()
