"""A user's first merge (issue 72): rank methods over layers 0-8 and a whole linear merge, each run with a fresh
state dir (no verification records to reuse), two checkouts alternated, outputs compared byte for byte.

Usage::

    python bench/bench_first_run.py --a /work/wt/firstrun [--b /tmp/base] [--mergekit] [--size 600MB] [--layers 27]
        [--hidden 512] [--runs 2] [--methods ties,breadcrumbs_ties,della,linear] [--work DIR] [--discard]

Generates four Llama-style float32 models of about ``--size`` bytes each (once, in ``--work``), then for every
method runs ``resumerge run`` of checkout A and of checkout B (``PYTHONPATH``, ``python -P``) in turn, ``--runs``
times, A first on odd rounds and B first on even ones, each into a new OUT with a new ``--state-dir``: wall and
user+system CPU of the merge process, and the machine's load (``uptime``) before each run. The rank methods merge
layers 0-8 of four models (a slice reads about a third of each file); ``linear`` merges two whole models, and is
compared with the disk floor (a warm read of both inputs plus an fsynced write of the output's size). Every
output's files must hash alike across A and B (the script stops otherwise). ``--mergekit`` adds mergekit 0.1.5's
``mergekit-yaml`` on the same config as a third command in the alternation (its outputs are not compared: DELLA
draws its own random masks). ``--discard`` deletes each output (and its state dir) once hashed, so the disk holds
one output at a time (two 7 GB merges alternated would hold three otherwise). Ends with markdown rows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]

from bench_linear import disk_floor  # noqa: E402  (warm read of the inputs, fsynced write of the output)

from resumerge.machine.memory.sizes import format_size, parse_size  # noqa: E402

RANK = {"ties": {"density": 0.5, "weight": 0.3}, "breadcrumbs_ties": {"density": 0.8, "gamma": 0.01, "weight": 0.3},
        "della": {"density": 0.5, "epsilon": 0.1, "weight": 0.3}}


def models(work: Path, size: int, layers: int, hidden: int, count: int = 4) -> list[Path]:
    """``count`` models of about ``size`` bytes (generated once)."""
    from resumerge.cli.modelgen import ModelSpec, make_model

    intermediate = hidden * 1376 // 512
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * intermediate)
    spec = ModelSpec(layers=layers, hidden=hidden, intermediate=intermediate, vocab=max(1000, (size - layers *
                     per_layer) // (8 * hidden)), heads=8, kv_heads=8, shard_bytes=200 << 20, tokenizer=False)
    found = []
    for seed in range(count):
        folder = work / (f"model-{seed}" if hidden == 512 else f"model-{hidden}-{seed}")
        if not (folder / "config.json").exists():
            make_model(folder, spec, seed=seed + 1)
        found.append(folder)
    return found


def config(work: Path, method: str, inputs: list[Path]) -> Path:
    path = work / f"{method}.yml"
    if method == "linear":
        text = "merge_method: linear\nmodels:\n" + "".join(
            f"  - model: {m}\n    parameters: {{weight: 0.5}}\n" for m in inputs[:2])
    else:
        params = ", ".join(f"{k}: {v}" for k, v in RANK[method].items())
        text = (f"merge_method: {method}\nbase_model: {inputs[0]}\nslices:\n  - sources:\n"
                f"      - model: {inputs[0]}\n        layer_range: [0, 9]\n" + "".join(
                    f"      - model: {m}\n        layer_range: [0, 9]\n        parameters: {{{params}}}\n"
                    for m in inputs[1:]) + "dtype: float32\n")
    path.write_text(text)
    return path


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average: ")[-1]


def merged(tree: Path, cfg: Path, out: Path, state: Path) -> tuple[float, float]:
    """One ``resumerge run`` of checkout ``tree``: (wall s, CPU s of the child)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-m", "resumerge", "run", str(cfg), str(out), "--state-dir", str(state),
                    "--quiet"], env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def mergekit_merged(cfg: Path, out: Path) -> tuple[float, float]:
    """One ``mergekit-yaml`` run of the same config: (wall s, CPU s of the child)."""
    exe = shutil.which("mergekit-yaml")
    if exe is None:
        raise SystemExit("mergekit-yaml is not on PATH (pip install mergekit==0.1.5)")
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([exe, str(cfg), str(out), "--random-seed", "0", "--quiet"], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.suffix in (".safetensors", ".json") and p.name != "resumerge-manifest.json"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, type=Path)
    parser.add_argument("--b", type=Path, help="a second checkout (git archive of main)")
    parser.add_argument("--mergekit", action="store_true", help="mergekit-yaml as a further command")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--size", default="600MB")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--methods", default="ties,breadcrumbs_ties,della,linear")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-first-run"))
    parser.add_argument("--discard", action="store_true", help="delete each output once hashed (a shared disk)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # linear alone merges two models: the other two are not generated for it.
    inputs = models(args.work, parse_size(args.size), args.layers, args.hidden,
                    2 if args.methods == "linear" else 4)
    print(f"models: {format_size(sum(p.stat().st_size for p in inputs[0].glob('*.safetensors')))} each, "
          f"{args.layers} layers")
    rows = []
    for method in args.methods.split(","):
        cfg = config(args.work, method, inputs)
        names = ["A"] + (["B"] if args.b else []) + (["mergekit"] if args.mergekit else [])
        times: dict[str, list[tuple[float, float, str]]] = {n: [] for n in names}
        outputs: dict[str, dict[str, str]] = {}
        out_bytes = 0
        for run in range(args.runs):
            for name in names if run % 2 == 0 else names[::-1]:
                seen = load()
                out = args.work / f"out-{method}-{name}"
                if name == "mergekit":
                    wall, cpu = mergekit_merged(cfg, out)
                else:
                    tree = args.a if name == "A" else args.b
                    wall, cpu = merged(tree, cfg, out, args.work / f"state-{method}-{name}")
                times[name].append((wall, cpu, seen))
                if name != "mergekit":
                    outputs[name] = hashes(out)
                    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
                if args.discard:
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(args.work / f"state-{method}-{name}", ignore_errors=True)
                print(f"{method} {name} run {run + 1}: {wall:.2f} s wall, {cpu:.2f} s CPU (load {seen})", flush=True)
        if "B" in outputs and outputs["A"] != outputs["B"]:
            raise SystemExit(f"{method}: the outputs of A and B differ")
        floor = ""
        if method == "linear":
            f = sum(disk_floor(inputs[:2], out_bytes, args.work))
            floor = f"{f:.2f} s floor; " + ", ".join(
                f"{n} {statistics.median(w for w, _, _ in times[n]) / f:.2f}x" for n in names)
        if "mergekit" in times:
            mk = statistics.median(w for w, _, _ in times["mergekit"])
            mk_cpu = statistics.median(c for _, c, _ in times["mergekit"])
            floor += ("; " if floor else "") + ", ".join(
                f"{n} {statistics.median(w for w, _, _ in times[n]) / mk:.2f}x mergekit's wall, "
                f"{statistics.median(c for _, c, _ in times[n]) / mk_cpu:.2f}x its CPU"
                for n in names if n != "mergekit")
        rows.append(f"| {method} | " + " | ".join(
            f"{statistics.median(w for w, _, _ in times[n]):.2f} s ({statistics.median(c for _, c, _ in times[n]):.2f}"
            f" CPU s; load {', '.join(s.split(',')[0] for _, _, s in times[n])})" for n in names)
            + f" | {floor} | {'byte-identical' if 'B' in outputs else '-'} |")
    print(f"| method | {' | '.join(names)} | floor / ratios | A vs B outputs |")
    print("|---|" + "---|" * len(names) + "---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
