"""``resumerge eval`` against lm-eval's own ``hf`` model (``lm_eval --model hf``, transformers, float32) on the same
CPU, model and tasks: wall time and peak RSS of each command, alternated, and whether their metrics agree; and
(``--bench``) eval's own figures: ``budget`` a generated model twice ``--max-memory`` evaluated within it (peak
RSS), ``resume`` an evaluation killed after a layer and resumed against one never interrupted, ``unwritten`` a merge
config evaluated unwritten against its written merge's evaluation (and the weight bytes it wrote), ``generate`` a
generation task with this tree's KV cache against ``--base``'s tree (``git archive`` of an older commit).

Usage::

    python bench/bench_eval.py [--bench hf,budget,resume,unwritten,generate] [--model DIR] [--runs 2] [--work DIR]
        [--max-memory SIZE] [--docs 40] [--base ROOT]

The model defaults to SmolLM2-135M-Instruct in float32 (tests/realmodel.py's fixture, 0.54 GB). The tasks are a
multiple-choice task (``--docs`` documents, four choices) and a perplexity task (``--docs`` / 4 documents of a few
hundred words), written as task YAMLs with local data files (offline). Each command runs in a fresh process (its
imports counted, as a user pays them) with a fresh state dir; peak RSS is the child's ``ru_maxrss``. Prints each
run, the median per command, ``uptime``'s load, and the two commands' metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_MEASURED = """
import resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - start
print(done.returncode, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.stderr.write(done.stderr[-3000:] if done.returncode else "")
"""


def _tasks(work: Path, docs: int) -> Path:
    from evaluation.evaltasks import MC, PPL, WORDS, _jsonl, _mc_rows

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = _jsonl(data / "train.jsonl", _mc_rows(1000, 8))
    test = _jsonl(data / "test.jsonl", _mc_rows(0, docs))
    texts = [" ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(300)) for i in range(max(1, docs // 4))]
    ppl = _jsonl(data / "ppl.jsonl", [{"text": t} for t in texts])
    tasks = work / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "tiny_mc.yaml").write_text(MC.format(train=train, test=test))
    (tasks / "tiny_ppl.yaml").write_text(PPL.format(test=ppl))
    return tasks


def _measured(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    done = subprocess.run([sys.executable, "-c", _MEASURED, *argv], capture_output=True, text=True, env=env)
    code, wall, peak = done.stdout.split()
    if code != "0":
        raise SystemExit(f"{argv[:4]} failed ({code}):\n{done.stderr}")
    return float(wall), int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", default="hf", help="comma-separated: hf, budget, resume, unwritten, generate")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-eval"))
    parser.add_argument("--max-memory", default=None)
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--base", type=Path, help="the tree ``generate`` compares with (git archive of a commit)")
    args = parser.parse_args()
    if args.model is None:
        from realmodel import smollm2_folder

        args.model = smollm2_folder()
    shutil.rmtree(args.work, ignore_errors=True)
    tasks = _tasks(args.work, args.docs)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(args.work / "hf"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    from bench_eval_more import BENCHES

    for bench in args.bench.split(","):
        if bench == "hf":
            _against_hf(args, tasks, env)
        else:
            BENCHES[bench](args, tasks, env)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def _against_hf(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    names = "tiny_mc,tiny_ppl"
    figures: dict[str, list[tuple[float, int]]] = {"resumerge eval": [], "lm_eval --model hf": []}
    outputs: dict[str, Path] = {}
    for run in range(args.runs):
        order = list(figures) if run % 2 == 0 else list(reversed(figures))
        for name in order:
            out = args.work / f"out-{run}-{name.split()[0]}"
            if name == "resumerge eval":
                argv = [sys.executable, "-m", "resumerge", "eval", str(args.model), "--tasks", names,
                        "--include-path", str(tasks), "--state-dir", str(args.work / f"state-{run}"), "-q",
                        "--output-path", str(out)]
                if args.max_memory:
                    argv += ["--max-memory", args.max_memory]
            else:
                argv = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={args.model},dtype=float32", "--tasks", names, "--include_path", str(tasks),
                        "--device", "cpu", "--output_path", str(out)]
            wall, peak = _measured(argv, env)
            figures[name].append((wall, peak))
            outputs[name] = out
            print(f"run {run + 1} {name}: {wall:.1f} s, peak RSS {peak / 2**20:.0f} MiB", flush=True)
    for name, found in figures.items():
        print(f"{name}: median {statistics.median(w for w, _ in found):.1f} s, "
              f"peak RSS {statistics.median(p for _, p in found) / 2**20:.0f} MiB")
    ours, theirs = (json.loads(next(outputs[n].rglob("results_*.json")).read_text())["results"] for n in figures)
    for task in ours:
        print(task, {k: v for k, v in ours[task].items() if "," in k})
        print(" " * len(task), {k: v for k, v in theirs[task].items() if "," in k})
    print(f"max RSS this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
