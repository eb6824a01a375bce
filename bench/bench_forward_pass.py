"""The one journaled layer pass (issue 66) against the code before it: ``check``, ``measure`` and a mergekit-moe
``gate_mode: hidden`` run, each through the command line of tree A and of tree B, alternated.

Usage::

    python bench/bench_forward_pass.py --a /work/wt/forward-pass --b /tmp/forward-pass-base [--runs 3]
                                       [--work DIR] [--layers 8] [--hidden 256]

Generates three Llama-style models (float32, ``--layers`` decoder layers of width ``--hidden``) in ``--work``,
then for each run and each tree (A first on odd runs, B first on even ones) times, in a fresh state dir and OUT:
``resumerge check MERGE --parent P --json``, ``resumerge measure`` of a two-model regmean config, and ``resumerge
run`` of a two-expert ``gate_mode: hidden`` config (its prompt forward pass is the MoE pass). Prints each run's
wall seconds, the median per tree and command, the load average, and whether A's and B's results are the same:
the check's report (its chart's path aside), the Gram files' bytes, the MoE output's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = (["def square(x): return x * x", "for i in range(10): print(i)"],
           ["The capital of France is Paris.", "Good morning, my friend."])


def _models(work: Path, layers: int, hidden: int) -> list[Path]:
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=2 * hidden, vocab=1024)
    return [make_model(work / f"model{seed}", spec, seed=seed) if not (work / f"model{seed}").is_dir()
            else work / f"model{seed}" for seed in range(3)]


def _configs(work: Path, models: list[Path]) -> tuple[Path, Path]:
    regmean = work / "regmean.yml"
    regmean.write_text(json.dumps({"merge_method": "regmean", "models": [{"model": str(m)} for m in models[:2]],
                                   "parameters": {"grams": "grams"}, "dtype": "float32"}))
    moe = work / "moe.yml"
    lines = [f"base_model: {models[0]}", "gate_mode: hidden", "dtype: float32", "experts:"]
    for i, prompts in enumerate(PROMPTS):
        lines += [f"  - source_model: {models[1 + i]}", "    positive_prompts:"] + [f"      - {p!r}" for p in prompts]
    moe.write_text("\n".join(lines) + "\n")
    return regmean, moe


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix == ".safetensors"}


def _timed(tree: Path, state: Path, *args: str | Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "RESUMERGE_STATE_DIR": str(state)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "resumerge", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=3600)
    return time.perf_counter() - start, done


def _one(tree: Path, name: str, work: Path, models: list[Path], regmean: Path, moe: Path, texts: Path
         ) -> dict[str, tuple[float, object]]:
    """Each command once with tree ``tree``; per command its wall seconds and what is compared."""
    found: dict[str, tuple[float, object]] = {}
    place = work / f"runs-{name}"
    shutil.rmtree(place, ignore_errors=True)
    place.mkdir()
    took, done = _timed(tree, place / "check-state", "check", models[0], "--parent", models[1], "--prompts", texts,
                        "--json")
    assert done.returncode in (0, 5, 6), done.stderr[-2000:]
    report = json.loads(done.stdout)
    report.pop("chart", None)
    found["check"] = (took, report)
    took, done = _timed(tree, place / "measure-state", "measure", regmean, place / "grams", "--texts", texts)
    assert done.returncode == 0, done.stderr[-2000:]
    found["measure"] = (took, _digests(place / "grams"))
    took, done = _timed(tree, place / "moe-state", "run", moe, place / "moe")
    assert done.returncode == 0, done.stderr[-2000:]
    found["moe hidden"] = (took, _digests(place / "moe"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True)
    parser.add_argument("--b", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-forward-pass"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    models = _models(args.work, args.layers, args.hidden)
    regmean, moe = _configs(args.work, models)
    texts = args.work / "texts.txt"
    texts.write_text("The capital of France is Paris, which is also its largest city.\n"
                     "def square(x):\n12 times 7 is 84, and its square root is about 9.17.\n"
                     "French: bonjour, mon ami. Spanish: buenos dias, mi amigo.\n")
    times: dict[tuple[str, str], list[float]] = {}
    results: dict[str, dict[str, object]] = {"A": {}, "B": {}}
    for run in range(args.runs):
        order = (("A", args.a), ("B", args.b)) if run % 2 == 0 else (("B", args.b), ("A", args.a))
        for name, tree in order:
            for command, (took, what) in _one(tree, name, args.work, models, regmean, moe, texts).items():
                times.setdefault((command, name), []).append(took)
                results[name][command] = what
                print(f"run {run + 1} {name} {command}: {took:.2f} s", flush=True)
    print(f"load average {os.getloadavg()}")
    for command in ("check", "measure", "moe hidden"):
        a, b = times[(command, "A")], times[(command, "B")]
        same = results["A"][command] == results["B"][command]
        ratio = statistics.median(a) / statistics.median(b)
        print(f"{command}: A median {statistics.median(a):.2f} s {[round(t, 2) for t in a]}, B median "
              f"{statistics.median(b):.2f} s {[round(t, 2) for t in b]}; A/B {ratio:.2f}; "
              f"results {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
