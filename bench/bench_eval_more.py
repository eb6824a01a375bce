"""``resumerge eval``'s own benches (bench/bench_eval.py ``--bench``): a model twice the budget, kill + resume, an
unwritten merge against the written one, generation with the KV cache against an older tree. Each command runs in
a fresh process (its imports counted) with a fresh state dir; the figures are its wall time, its peak RSS
(``ru_maxrss``) and the bytes it wrote (``ru_oublock``: the pages it dirtied, as the kernel counts them)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

_MEASURED = """
import resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - start
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(done.returncode, wall, use.ru_maxrss * 1024, use.ru_oublock * 512)
sys.stderr.write(done.stderr[-3000:] if done.returncode not in (0, -9) else "")
"""
MB = 2**20
def measured(argv: list[str], env: dict[str, str], killed: bool = False) -> tuple[float, int, int]:
    """Wall seconds, peak RSS and bytes written of ``argv`` in a fresh process (``killed``: it is meant to die by
    SIGKILL)."""
    done = subprocess.run([sys.executable, "-c", _MEASURED, *argv], capture_output=True, text=True, env=env)
    code, wall, peak, written = done.stdout.split()
    if code != ("-9" if killed else "0"):
        raise SystemExit(f"{argv[:4]} ended with {code}:\n{done.stderr}")
    return float(wall), int(peak), int(written)


def eval_argv(target: Path, tasks: str, include: Path, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "resumerge", "eval", str(target), "--tasks", tasks, "--include-path", str(include),
            "--state-dir", str(state), "-q", *extra]


def _texts(work: Path) -> Path:
    from evaluation.evaltasks import WORDS

    path = work / "texts.txt"
    path.write_text("\n".join(" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(40)) for i in range(4)) + "\n")
    return path


def _say(name: str, wall: float, peak: int, written: int) -> None:
    print(f"{name}: {wall:.1f} s, peak RSS {peak / MB:.0f} MiB, wrote {written / MB:.1f} MiB", flush=True)


def budget(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """A generated model twice ``--max-memory`` (default 1.2GB) evaluated within it: ``tiny_mc`` (4 documents)
    and ``nll`` on 4 texts of 40 words."""
    from resumerge.cli.modelgen import ModelSpec, make_model, write_tokenizer
    from resumerge.machine.memory import parse_size

    limit = parse_size(args.max_memory or "1.2GB")
    layer = (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632) * 4
    spec = ModelSpec(layers=max(1, round(2 * limit / layer)), hidden=2048, intermediate=5632, vocab=64)
    started = time.perf_counter()
    model = make_model(args.work / "big", spec)
    write_tokenizer(model, spec.vocab)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    made = time.perf_counter() - started
    print(f"budget: model of {spec.layers} layers, {size / 1e9:.2f} GB (made in {made:.0f} s), "
          f"--max-memory {limit / 1e9:.2f} GB", flush=True)
    argv = eval_argv(model, f"tiny_mc,nll:{_texts(args.work)}", tasks, args.work / "state-big", "--limit", "4",
                     "--max-memory", str(limit))
    wall, peak, written = measured(argv, env)
    _say("budget: eval", wall, peak, written)
    print(f"budget: peak {peak / 1e9:.2f} GB = {peak / limit:.2f}x the budget, model {size / limit:.2f}x it")


def budget_real(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """``--model`` (a Llama-shaped folder of one safetensors file: SmolLM2-135M) deepened to twice ``--max-memory``
    (default 600MB: above the ~490 MiB that torch, transformers, lm-eval and the tokenizer take before a weight is
    read) and evaluated within it on ``tiny_mc`` and ``tiny_ppl``: real weights and tokenizer, peak RSS against
    the budget."""
    from bench_eval import deepened

    from resumerge.machine.memory import parse_size

    limit = parse_size(args.max_memory or "600MB")
    config = json.loads((args.model / "config.json").read_text())
    size = (args.model / "model.safetensors").stat().st_size
    count = int(config["num_hidden_layers"])
    embed = int(config["vocab_size"]) * int(config["hidden_size"]) * 4
    layers = round((2 * limit - embed) / ((size - embed) / count))
    model = deepened(args.model, layers, args.work)
    grown = (model / "model.safetensors").stat().st_size
    print(f"budget-real: {layers} layers, {grown / 1e9:.2f} GB, --max-memory {limit / 1e9:.2f} GB", flush=True)
    wall, peak, written = measured(eval_argv(model, "tiny_mc,tiny_ppl", tasks, args.work / "state-budget-real",
                                             "--max-memory", str(limit)), env)
    _say("budget-real: eval", wall, peak, written)
    print(f"budget-real: peak {peak / 1e9:.3f} GB = {peak / limit:.2f}x the budget, model {grown / limit:.2f}x it")


def resume(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """``--model`` on ``tiny_mc`` (``--docs`` documents) and ``nll``: uninterrupted, and killed after the middle
    layer of its first pass then run again, alternated over ``--runs``."""
    names = f"tiny_mc,nll:{_texts(args.work)}"
    config = json.loads((args.model / "config.json").read_text())
    half = int((config.get("text_config") or config)["num_hidden_layers"]) // 2
    ratios = []
    for run in range(args.runs):
        found: dict[str, float] = {}
        for name in (("whole", "killed") if run % 2 == 0 else ("killed", "whole")):
            state = args.work / f"state-resume-{name}-{run}"
            if name == "whole":
                wall, peak, written = measured(eval_argv(args.model, names, tasks, state), env)
                _say(f"resume run {run + 1}: uninterrupted", wall, peak, written)
                found[name] = wall
            else:
                kill = {**env, "RESUMERGE_KILL_AT": f"after_eval_layer:{half}"}
                first, peak, written = measured(eval_argv(args.model, names, tasks, state), kill, killed=True)
                _say(f"resume run {run + 1}: killed after layer {half}", first, peak, written)
                second, peak, written = measured(eval_argv(args.model, names, tasks, state), env)
                _say(f"resume run {run + 1}: resumed", second, peak, written)
                found[name] = first + second
        ratios.append(found["killed"] / found["whole"])
        print(f"resume run {run + 1}: killed + resumed = {ratios[-1]:.2f}x uninterrupted", flush=True)


def unwritten(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """A linear merge of ``--model`` and a copy of it with noise added, evaluated unwritten (the config as TARGET)
    and written (``resumerge run`` first, not timed), on ``tiny_mc`` and ``nll``, alternated over ``--runs``."""
    import torch
    from safetensors.torch import load_file, save_file

    other = args.work / "other"
    other.mkdir()
    for path in args.model.iterdir():
        if path.suffix == ".safetensors":
            generator = torch.Generator().manual_seed(0)
            tensors = {k: (v + 1e-3 * torch.randn(v.shape, generator=generator)).contiguous()
                       for k, v in load_file(str(path)).items()}
            save_file(tensors, str(other / path.name), metadata={"format": "pt"})
            del tensors
        elif path.is_file():
            (other / path.name).write_bytes(path.read_bytes())
    config = args.work / "merge.yml"
    config.write_text(json.dumps({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(args.model), "parameters": {"weight": 0.5}},
        {"model": str(other), "parameters": {"weight": 0.5}}]}))
    out = args.work / "merged"
    subprocess.run([sys.executable, "-m", "resumerge", "run", str(config), str(out), "--state-dir",
                    str(args.work / "state-run")], env=env, check=True, capture_output=True)
    names = f"tiny_mc,nll:{_texts(args.work)}"
    for run in range(args.runs):
        found = {}
        for name in (("unwritten", "written") if run % 2 == 0 else ("written", "unwritten")):
            state = args.work / f"state-{name}-{run}"
            wall, peak, written = measured(eval_argv(config if name == "unwritten" else out, names, tasks, state), env)
            weights = sum(p.stat().st_size for p in state.rglob("*.safetensors"))
            _say(f"unwritten run {run + 1}: {name}", wall, peak, written)
            print(f"unwritten run {run + 1}: {name}: weight files left in its state dir: {weights} bytes")
            found[name] = wall
        print(f"unwritten run {run + 1}: unwritten = {found['unwritten'] / found['written']:.2f}x written", flush=True)


def generate(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """A generation task (``--docs`` / 5 documents, 32 new tokens each, no stop sequence met) on ``--model`` and
    on a generated tiny model (context 256), with this tree and with ``--base``'s, alternated over ``--runs``."""
    from evaluation.evaltasks import _jsonl, _mc_rows, generate_task, tiny_model

    if args.base is None:
        raise SystemExit("--bench generate needs --base ROOT (git archive <commit> | tar -x -C ROOT)")
    include = args.work / "gen"
    include.mkdir()
    test = _jsonl(args.work / "gen.jsonl", _mc_rows(0, max(1, args.docs // 5)))
    gen = generate_task("bench_gen", text="Question {{question}} Answer", target="{{choices[0]}}", until="<never>",
                        tokens=32, greedy=True)
    (include / "bench_gen.yaml").write_text(gen.format(test=test))
    tiny = tiny_model(args.work / "tiny-gen", context=256)
    for model in (tiny, args.model):
        for run in range(args.runs):
            found: dict[str, float] = {}
            for tree in ((ROOT, args.base) if run % 2 == 0 else (args.base, ROOT)):
                label = "KV cache" if tree == ROOT else "no cache (base)"
                state = args.work / f"state-gen-{model.name}-{run}-{label[:2]}"
                wall, peak, written = measured(eval_argv(model, "bench_gen", include, state, "--json"),
                                               {**env, "PYTHONPATH": str(tree)})
                _say(f"generate {model.name} run {run + 1}: {label}", wall, peak, written)
                found[label] = wall
            print(f"generate {model.name} run {run + 1}: KV cache = "
                  f"{found['KV cache'] / found['no cache (base)']:.2f}x no cache", flush=True)


def kvcache(args: argparse.Namespace, tasks: Path, env: dict[str, str]) -> None:
    """In this process, the generation loop alone: 32 greedy tokens after a 128-token context with the KV cache
    (:func:`~resumerge.analyses.evaluation.generate.resident`) against the whole sequence run again at each step
    (what generation did before), on a generated tiny model (context 256) and on ``--model``, alternated over
    ``--runs``; the tokens must be the same."""
    import torch
    from evaluation.evaltasks import tiny_model

    from resumerge.analyses.evaluation.generate import cached_stream, resident
    from resumerge.analyses.evaluation.genrequests import Wanted
    from resumerge.config.locations import StateDir
    from resumerge.forward.engine.reader import Weights
    from resumerge.forward.opening.opened import open_for_pass

    tiny = tiny_model(args.work / "tiny-kv", context=256)
    for model in (tiny, args.model):
        opened = open_for_pass(str(model), "the model", StateDir.resolve(args.work / "state-kv")).opened
        stream = cached_stream(Weights.of(opened.directory, opened.tensors), opened.config, torch.float32)
        vocab = int(opened.config.get("vocab_size", 64))
        context = [(i * 7 + 3) % min(vocab, 60) + 3 for i in range(128)]
        with torch.no_grad(), resident(stream) as greedy:
            for run in range(args.runs):
                found: dict[str, float] = {}
                tokens: dict[str, list[int]] = {}
                for name in (("cache", "none") if run % 2 == 0 else ("none", "cache")):
                    start = time.perf_counter()
                    if name == "cache":
                        made = []
                        for token in greedy(Wanted(tuple(context), (), 32, None, -1), None):
                            made.append(token)
                            if len(made) == 32:
                                break
                    else:
                        made = []
                        while len(made) < 32:
                            out = stream.model(input_ids=torch.tensor([context + made]), use_cache=False)
                            made.append(int(out.logits[0, -1].argmax()))
                    found[name], tokens[name] = time.perf_counter() - start, made
                assert tokens["cache"] == tokens["none"], "the cache changed the greedy tokens"
                print(f"kvcache {model.name} run {run + 1}: 32 tokens after 128: cache {found['cache']:.2f} s, "
                      f"whole sequence each step {found['none']:.2f} s: {found['none'] / found['cache']:.1f}x "
                      "faster, the same tokens", flush=True)
        stream.close()


BENCHES: dict[str, Callable[[argparse.Namespace, Path, dict[str, str]], None]] = {
    "budget": budget, "budget-real": budget_real, "resume": resume, "unwritten": unwritten, "generate": generate,
    "kvcache": kvcache}
