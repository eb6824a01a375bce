"""``resumerge eval`` against lm-eval's own ``hf`` model (``lm_eval --model hf``, transformers, float32) on the same
CPU, model and tasks: wall time and peak RSS of each command, alternated, and whether their metrics agree; and
(``--bench``) eval's own figures: ``budget`` a generated model twice ``--max-memory`` evaluated within it (peak
RSS), ``resume`` an evaluation killed after a layer and resumed against one never interrupted, ``unwritten`` a merge
config evaluated unwritten against its written merge's evaluation (and the weight bytes it wrote), ``generate`` a
generation task with this tree's KV cache against ``--base``'s tree (``git archive`` of an older commit).

Usage::

    python bench/bench_eval.py [--bench hf,budget,budget-real,resume,unwritten,generate] [--model DIR] [--runs 2]
        [--work DIR] [--max-memory SIZE] [--docs 40] [--base ROOT] [--deepen LAYERS] [--hf-batch-size N]

    # the issue's ~1 GB model: SmolLM2-135M's layers repeated to 60 (0.96 GB float32, its real tokenizer)
    python bench/bench_eval.py --deepen 60 --runs 2 --docs 8

The model defaults to SmolLM2-135M-Instruct in float32 (tests/realmodel.py's fixture, 0.54 GB). The tasks are a
multiple-choice task (``--docs`` documents, four choices) and a perplexity task (``--docs`` / 4 documents of a few
hundred words), written as task YAMLs with local data files (offline). Each command runs in a fresh process (its
imports counted, as a user pays them) with a fresh state dir; peak RSS is the child's ``ru_maxrss`` and, beside it,
the peak of its whole process tree's summed RSS (polled 20 times a second); CPU time is the tree's user + system
seconds (what a loaded machine's wall time hides). Prints each run with the load when it started and ended, the
median per command, their ratios, and the two commands' metrics.
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
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_MEASURED = """
import os, resource, subprocess, sys, threading, time
import psutil
load = os.getloadavg()[0]
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
tree_peak = 0
def poll():
    # the summed RSS of the command and every process it started, 20 times a second (ru_maxrss is one process's)
    global tree_peak
    root = psutil.Process(child.pid)
    while child.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
            tree_peak = max(tree_peak, sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass
        time.sleep(0.05)
watcher = threading.Thread(target=poll, daemon=True)
watcher.start()
err = child.communicate()[1]
wall = time.perf_counter() - start
watcher.join()
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(child.returncode, wall, use.ru_maxrss * 1024, tree_peak, use.ru_utime + use.ru_stime, load,
      os.getloadavg()[0])
sys.stderr.write(err[-3000:] if child.returncode else "")
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


class Measured(NamedTuple):
    """One command's figures: wall seconds, its largest process's peak RSS (``ru_maxrss``), the peak of its whole
    process tree's summed RSS (polled), user + system CPU seconds of the tree, and the 1-minute load average when it
    started and when it ended."""

    wall: float
    peak: int
    tree_peak: int
    cpu: float
    load_before: float
    load_after: float


def _measured(argv: list[str], env: dict[str, str]) -> Measured:
    done = subprocess.run([sys.executable, "-c", _MEASURED, *argv], capture_output=True, text=True, env=env)
    code, *figures = done.stdout.split()
    if code != "0":
        raise SystemExit(f"{argv[:4]} failed ({code}):\n{done.stderr}")
    wall, peak, tree, cpu, before, after = figures
    return Measured(float(wall), int(peak), int(tree), float(cpu), float(before), float(after))


def deepened(source: Path, layers: int, work: Path) -> Path:
    """A deeper copy of the Llama-shaped model ``source``: its decoder layers repeated in order until there are
    ``layers`` of them (layer ``i`` is source layer ``i % n``), its embeddings, norm and tokenizer as they are. Real
    weights and a real tokenizer, so the texts' log-likelihoods are a trained model's, at the size the issue's bench
    names (SmolLM2-135M deepened to 60 layers: 0.97 GB in float32)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = work / f"deep-{layers}"
    config = json.loads((source / "config.json").read_text())
    count = int(config["num_hidden_layers"])
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as opened:
        for name in opened.keys():  # noqa: SIM118 (safe_open is not iterable)
            if not name.startswith("model.layers."):
                tensors[name] = opened.get_tensor(name).clone()
                continue
            index, rest = name[len("model.layers."):].split(".", 1)
            for copy in range(int(index), layers, count):
                tensors[f"model.layers.{copy}.{rest}"] = opened.get_tensor(name).clone()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copyfile(path, out / path.name)
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", default="hf", help="comma-separated: hf, budget, resume, unwritten, generate")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-eval"))
    parser.add_argument("--max-memory", default=None)
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--base", type=Path, help="the tree ``generate`` compares with (git archive of a commit)")
    parser.add_argument("--deepen", type=int, default=0,
                        help="bench a copy of --model with its layers repeated to this many (60: SmolLM2 at 0.97 GB)")
    parser.add_argument("--hf-batch-size", default="1", help="lm-eval's --batch_size (resumerge batches a pass's "
                        "sequences by padded tokens, forward/text/batches.py) [default: 1, lm-eval's own default]")
    args = parser.parse_args()
    if args.model is None:
        from realmodel import smollm2_folder

        args.model = smollm2_folder()
    shutil.rmtree(args.work, ignore_errors=True)
    tasks = _tasks(args.work, args.docs)
    if args.deepen:
        args.model = deepened(args.model, args.deepen, args.work)
        size = sum(p.stat().st_size for p in args.model.glob("*.safetensors"))
        print(f"model: {args.model} ({args.deepen} layers, {size / 1e9:.2f} GB)", flush=True)
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
    figures: dict[str, list[Measured]] = {"resumerge eval": [], "lm_eval --model hf": []}
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
                        "--device", "cpu", "--output_path", str(out), "--batch_size", args.hf_batch_size]
            found = _measured(argv, env)
            figures[name].append(found)
            outputs[name] = out
            print(f"run {run + 1} {name}: {found.wall:.1f} s wall, {found.cpu:.1f} s CPU, peak RSS "
                  f"{found.peak / 2**20:.0f} MiB (process tree {found.tree_peak / 2**20:.0f} MiB), load "
                  f"{found.load_before:.2f} -> {found.load_after:.2f}", flush=True)
    medians = {}
    for name, runs in figures.items():
        medians[name] = Measured(*(statistics.median(getattr(r, f) for r in runs) for f in Measured._fields))
        m = medians[name]
        print(f"{name}: median {m.wall:.1f} s wall, {m.cpu:.1f} s CPU, peak RSS {m.peak / 2**20:.0f} MiB "
              f"(tree {m.tree_peak / 2**20:.0f} MiB)")
    ours, theirs = medians.values()
    print(f"resumerge / lm-eval: {ours.wall / theirs.wall:.2f}x wall, {ours.cpu / theirs.cpu:.2f}x CPU, "
          f"{ours.peak / theirs.peak:.2f}x peak RSS, {ours.tree_peak / theirs.tree_peak:.2f}x tree peak")
    results = [json.loads(next(outputs[n].rglob("results_*.json")).read_text())["results"] for n in figures]
    for task in results[0]:
        print(task, {k: v for k, v in results[0][task].items() if "," in k})
        print(" " * len(task), {k: v for k, v in results[1][task].items() if "," in k})
    print(f"max RSS this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
