"""``resumerge eval``'s layer-streamed generation (``generate_until`` on a model that does not fit ``--max-memory``:
one decoder layer at a time for every request, :mod:`resumerge.analyses.evaluation.streamgen`) against the floor of
reading the model's bytes once per token step, and beside the whole-model path where the model fits.

Usage::

    python bench/bench_generate_stream.py [--model DIR] [--deepen 60] [--requests 8] [--tokens 16] [--work DIR]

The model defaults to SmolLM2-135M-Instruct in float32 (tests/realmodel.py's fixture, 0.54 GB); ``--deepen 60``
repeats its layers to 60 (0.97 GB, bench_eval.py's ``deepened``): the issue's ~1 GB model. The task is a
``generate_until`` task with local data: ``--requests`` contexts of about 60 tokens, ``--tokens`` new tokens each (a
stop sequence that never appears). Each case runs in a fresh process with a fresh state dir:

- ``streamed``: ``--max-memory`` the process's resident set after a tiny model's evaluation (the evaluation's
  imports and machinery held) plus half the model's float32 size
  (the whole model does not fit it); every token step's wall time from the progress the generation reports (the
  first step, each context whole, apart), its plan line, and the process's peak RSS (``ru_maxrss``) against the
  budget.
- ``whole``: no ``--max-memory``: the model held whole (transformers' KV cache, one request after another).

The floor of a token step is the bytes it reads (:func:`~resumerge.analyses.evaluation.genplan.step_read_bytes`:
every layer, the final norm and the head, once for every request) over the disk's read speed: cold (the file's
pages dropped first, :func:`~resumerge.machine.diskprobe.probe_file_read`) and warm (the page cache's: the file read
again at once). Prints the load average before and after each case (the machine is shared) and the CPU seconds a
step takes (every thread's: what a loaded machine's wall time hides).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, ROOT / "tests", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_SENTENCE = ("the river ran past the old mill where the miller kept his grain and his cat slept by the door while "
          "children played in the field beyond the hedge and the sun went down over the hills")


def write_task(folder: Path, requests: int, tokens: int) -> Path:
    """A generation task over ``requests`` contexts of about 60 tokens, ``tokens`` new tokens each."""
    from evaluation.evaltasks import generate_task

    folder.mkdir(parents=True, exist_ok=True)
    rows, vocabulary = [], _SENTENCE.split(" ")
    for i in range(requests):
        words = [vocabulary[(i * 5 + k) % len(vocabulary)] for k in range(40 + 3 * i)]
        rows.append({"text": " ".join(words).capitalize() + ".", "target": "x"})
    data = folder / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = generate_task("bench_gen", text="{{text}}", target="{{target}}", until="zzzzqqqq", tokens=tokens)
    (folder / "bench_gen.yaml").write_text(task.format(test=data))
    return folder


def child(case: str, model: Path, tasks: Path, state: Path) -> dict[str, Any]:
    """One case in this process: the evaluation's figures as JSON."""
    from evaluation.evaltasks import tiny_model, write_tasks

    from resumerge import api
    from resumerge.machine.memory import SystemProbe

    # a tiny model's generation first: what the evaluation's machinery holds (lm-eval, datasets, transformers) is
    # held when the resident set is read, as it is when the generation's budget is judged
    warm = state.with_name(state.name + "-warm")
    api.evaluate(tiny_model(warm / "model"), "tiny_gen", api.Settings(state_dir=warm / "s"),
                 harness=api.Harness(include_path=write_tasks(warm)))
    size = (model / "model.safetensors").stat().st_size
    rss = SystemProbe().rss()
    budget = rss + size // 2 if case == "streamed" else None
    marks: list[tuple[float, float, int | None, int | None]] = []
    plans: list[str] = []

    def progress(step: Any) -> None:
        if step.plan is not None:
            plans.append(step.plan)
        elif step.kind == "generate_until":
            marks.append((time.perf_counter(), time.process_time(), step.step, step.layer))

    started = time.perf_counter()
    settings = api.Settings(resources=api.Resources(max_memory=budget), state_dir=state)
    report = api.evaluate(model, "bench_gen", settings, harness=api.Harness(include_path=tasks, log_samples=True),
                          progress=progress)
    wall = time.perf_counter() - started
    starts: dict[int, tuple[float, float]] = {}
    for when, cpu, step, layer in marks:
        if step is not None and layer == 0 and step not in starts:
            starts[step] = (when, cpu)
    ordered = [starts[s] for s in sorted(starts)]
    steps = [b[0] - a[0] for a, b in pairwise(ordered)]
    cpu = [b[1] - a[1] for a, b in pairwise(ordered)]
    answers = [s["resps"][0][0] for s in report.results["samples"]["bench_gen"]]
    return {"case": case, "wall_s": wall, "budget": budget, "rss_before": rss,
            "peak_rss": _peak_rss(), "plan": plans,
            "first_step_s": steps[0] if steps else None, "step_s": steps[1:], "step_cpu_s": cpu[1:],
            "answers": answers}


def floor_speeds(path: Path) -> tuple[float | None, float]:
    """The file's cold read speed (its pages dropped first) and warm (read twice, the second timed), bytes/s."""
    from resumerge.machine.diskprobe import probe_file_read

    cold = probe_file_read(path, 256 << 20)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return cold, path.stat().st_size / (time.perf_counter() - started)


def step_bytes(model: Path) -> int:
    """What one token step reads of ``model``'s weights."""
    from resumerge.analyses.evaluation.generate import cached_stream
    from resumerge.analyses.evaluation.genplan import step_read_bytes
    from resumerge.config.locations import StateDir
    from resumerge.forward.engine.reader import Weights
    from resumerge.forward.opening.opened import open_for_pass
    from resumerge.machine.torch_import import torch

    opened = open_for_pass(str(model), "TARGET", StateDir.resolve(None))
    weights = Weights.of(opened.opened.directory, opened.opened.tensors, opened.remote)
    with cached_stream(weights, opened.opened.config, torch.float32) as stream:
        return step_read_bytes(stream)



def _peak_rss() -> int:
    """This process's peak resident set since its exec (``VmHWM``): ``ru_maxrss`` carries the parent's across the
    fork and exec that started it (the parent that built a ``--deepen`` model held 1.7 GB: both cases read that)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--deepen", type=int, default=0)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-generate-stream"))
    parser.add_argument("--child", nargs=4, metavar=("CASE", "MODEL", "TASKS", "STATE"))
    args = parser.parse_args()
    if args.child:
        case, model, tasks, state = args.child
        print(json.dumps(child(case, Path(model), Path(tasks), Path(state))))
        return
    if args.model is None:
        from realmodel import smollm2_folder

        args.model = smollm2_folder()
    if args.deepen:
        from bench_eval import deepened

        args.model = deepened(args.model, args.deepen, args.work)
    size = (args.model / "model.safetensors").stat().st_size
    tasks = write_task(args.work / "tasks", args.requests, args.tokens)
    read = step_bytes(args.model)
    cold, warm = floor_speeds(args.model / "model.safetensors")
    print(f"model {args.model}: {size / 1e9:.2f} GB; a token step reads {read / 1e6:.0f} MB; disk cold "
          f"{(cold or 0) / 1e6:.0f} MB/s, page cache {warm / 1e6:.0f} MB/s", flush=True)
    found = {}
    for case in ("streamed", "whole"):
        state = args.work / f"state-{case}"
        subprocess.run(["rm", "-rf", str(state), f"{state}-warm"], check=True)
        load = os.getloadavg()[0]
        done = subprocess.run([sys.executable, __file__, "--child", case, str(args.model), str(tasks), str(state)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:])
            raise SystemExit(f"{case} failed")
        found[case] = json.loads(done.stdout.strip().splitlines()[-1])
        found[case]["load"] = (load, os.getloadavg()[0])
    streamed, whole = found["streamed"], found["whole"]
    step = statistics.median(streamed["step_s"]) if streamed["step_s"] else float("nan")
    floor_cold = read / cold if cold else float("nan")
    floor_warm = read / warm
    print(f"plan: {streamed['plan'][0] if streamed['plan'] else '(none)'}")
    print(f"streamed: budget {streamed['budget'] / 1e9:.2f} GB (resident set {streamed['rss_before'] / 1e9:.2f} GB "
          f"warm + half the model), peak RSS {streamed['peak_rss'] / 1e9:.2f} GB "
          f"({'within' if streamed['peak_rss'] <= streamed['budget'] else 'OVER'} the budget); "
          f"load {streamed['load'][0]:.1f}->{streamed['load'][1]:.1f}")
    print(f"  token step (median of {len(streamed['step_s'])}, the prefill apart): {step:.3f} s; prefill "
          f"{streamed['first_step_s'] or float('nan'):.3f} s; the evaluation {streamed['wall_s']:.1f} s")
    cpu = statistics.median(streamed["step_cpu_s"]) if streamed["step_cpu_s"] else float("nan")
    print(f"  CPU seconds a token step (median, every thread): {cpu:.3f}")
    print(f"  floor: {floor_cold:.3f} s cold ({step / floor_cold:.2f}x), {floor_warm:.3f} s from the page cache "
          f"({step / floor_warm:.2f}x)")
    print(f"whole: the evaluation {whole['wall_s']:.1f} s, peak RSS {whole['peak_rss'] / 1e9:.2f} GB; load "
          f"{whole['load'][0]:.1f}->{whole['load'][1]:.1f}")
    print(f"the same answers: {streamed['answers'] == whole['answers']}")


if __name__ == "__main__":
    main()
