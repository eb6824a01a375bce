"""``evolve``, ``check`` and ``eval`` with ``--device cuda`` against the CPU on the same machine: wall, CPU seconds,
peak RSS, and how far the GPU's figures are from the CPU's.

Usage (on a machine with a CUDA GPU)::

    python bench/bench_gpu_passes.py [--work DIR] [--layers 12 --hidden 1536 --intermediate 4096 --vocab 16000]
        [--popsize 8]

Makes three generated Llama-style float32 models (base, a, b; ``bench_evolve.py``'s generator, kept in ``--work``)
and a text file, then runs each command as a fresh process, once on the CPU and once with ``--device cuda``:
``evolve`` one generation of ``--popsize`` candidates (a ``ties`` genome, a ``kl`` task from ``a``), ``check a
--base base --parent b``, and ``eval a --tasks nll:TEXTS``. Prints markdown rows for bench/RESULTS.md; the last
column is the largest relative difference of a figure between the two devices (the search's objectives, the
check's figures, the eval's metric)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_evolve import STREAMED, _setup, _timed  # noqa: E402


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _numbers(value: object) -> list[float]:
    """Every float in a JSON value, in order (the figures two devices' answers are compared by)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _numbers(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-gpu-passes"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--popsize", type=int, default=8)
    args = parser.parse_args()
    # bench_evolve's _setup reads its own flags: one kl task, the parents' own tokenizer (no --parent-vocab).
    args.tasks = 1
    args.parent_vocab = None
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = _setup(work, args)
    tree = HERE.parent
    python = [sys.executable, "-c", STREAMED]
    size = sum(f.stat().st_size for f in (work / "a").glob("*.safetensors")) / 1e9
    print(f"models: 3 x {size:.2f} GB float32 ({args.layers} layers, hidden {args.hidden})", flush=True)
    print("| command | device | wall s | CPU s | peak RSS MB | figures vs CPU (largest rel. diff) |")
    print("|---|---|---|---|---|---|")
    steps = {
        "evolve": lambda device, tag: [*python, "evolve", str(config), str(work / f"store-{tag}"), "--popsize",
                                       str(args.popsize), "--max-fevals", str(args.popsize), "--json",
                                       *device],
        "check": lambda device, tag: [*python, "check", str(work / "a"), "--base", str(work / "base"), "--parent",
                                      str(work / "b"), "--state-dir", str(work / f"state-check-{tag}"), "--json",
                                      *device],
        "eval": lambda device, tag: [*python, "eval", str(work / "a"), "--tasks", f"nll:{work / 'texts.txt'}",
                                     "--state-dir", str(work / f"state-eval-{tag}"), "--json", *device],
    }
    for name, argv in steps.items():
        answers: dict[str, object] = {}
        for tag, device in (("cpu", []), ("cuda", ["--device", "cuda"])):
            wall, cpu, peak, stdout = _timed(argv(device, tag), tree)
            if name == "evolve":
                rows = (work / f"store-{tag}" / "evaluations.jsonl").read_text().splitlines()
                answers[tag] = [json.loads(r)["objective"] for r in rows]
            else:
                found = json.loads(stdout[stdout.index("{"):stdout.rindex("}") + 1])
                # the figures only (a check's answer also holds paths and the proof's counts, an eval's its timings)
                answers[tag] = (found["results"] if name == "eval" else
                                [{k: m[k] for k in ("nll", "kl", "kl_p95", "top1", "drift", "base_kl")}
                                 for m in found["models"]])
            differs = ""
            if tag == "cuda":
                want, got = _numbers(answers["cpu"]), _numbers(answers["cuda"])
                differs = (f"{max((_rel(w, g) for w, g in zip(want, got)), default=0.0):.1e} over {len(want)}"
                           if len(want) == len(got) else f"different shapes ({len(want)} vs {len(got)} numbers)")
            print(f"| {name} | {tag} | {wall:.2f} | {cpu:.1f} | {peak / 2**20:.0f} | {differs} |", flush=True)


if __name__ == "__main__":
    main()
