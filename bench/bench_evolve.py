"""One generation of ``resumerge evolve`` scored in one streamed pass against the same candidates each merged to
disk and scored alone (the loop mergekit-evolve runs on a CPU: per candidate a merge written, loaded, evaluated).

Usage::

    PYTHONPATH=TREE python bench/bench_evolve.py [--layers 6 --hidden 768 --intermediate 2048 --vocab 16000]
        [--popsize 8] [--runs 2] [--tasks 1] [--base OTHER_TREE] [--max-memory SIZE] [--streamed-only] [--mergekit]
        [--lmeval] [--only STEP ...]

Makes three generated Llama-style float32 models (base, a, b) under the temp dir once and ``--tasks`` tasks' texts
(a ``kl`` task from a, then alternately an ``nll`` task and a ``kl`` task from b), then alternates, each step a
fresh process (its wall time from its start, its CPU seconds (user + system, its children's included: on a shared
machine the figure load inflates least), its own peak RSS, ``VmHWM``): ``streamed`` is
``resumerge evolve CONFIG STORAGE --popsize P --max-fevals P`` (one generation: each candidate a merge never
written, every candidate's layer merged from one read of the parents' layer); ``base`` the same command on
``--base``'s tree (main, for an A/B: its table must be byte-identical); ``written`` is the same search with each
candidate merged by ``run`` into STORAGE and scored alone on the written merge
(``resumerge.api.evolution.evolve_into(..., written=True)``). Every table must hold the same figures to 1e-6.
``--mergekit``: the loop mergekit-evolve itself runs on a CPU, on the same candidates' configs
(``bench/evolve_mergekit_loop.py``: mergekit 0.1.5 writes each merge, transformers loads it, its figures are taken
from its logits; their largest relative difference from the streamed figures is printed, not asserted: another
forward pass, another tokenization). ``--lmeval``: mergekit's loop evaluates each candidate as mergekit-evolve's
actor does, through ``lm_eval.simple_evaluate`` once per candidate (the merge and its tokenizer loaded by lm-eval's
``hf`` model, every task set up again; see ``bench/evolve_mergekit_loop.py``). ``--max-memory`` is given to the
streamed searches (``--streamed-only``: the written loop is not run: a search over models larger than the budget).
``--only STEP ...`` runs just those steps (``streamed``, ``base``, ``written``, ``mergekit``, ``shared``), so that
steps of a large bench can take the bench lock one at a time; ``mergekit`` needs ``configs.json``, written by the
first ``streamed``. ``--parent-vocab rows|string`` adds the step ``shared``: the streamed search with the first ``kl``
task's parent of another vocabulary (``rows``: ``a`` with 128 tokens added, its embedding and head rows past a's
new; ``string``: ``a`` with its tokenizer's ids reversed and its embedding and head rows permuted alike, the same
model matched by token string), measured over the shared tokens as ``eval`` measures it: the cost of the
shared-token objective against the same-vocabulary one (its table is its own: another parent).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import parents
from childtime import timed_run, tree_env

if TYPE_CHECKING:
    from resumerge.cli.modelgen import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
PEAK = """
from resumerge.machine.memory import os_peak_rss
import atexit
atexit.register(lambda: print("peak", os_peak_rss(), flush=True))
"""
STREAMED = PEAK + """
import sys
from resumerge.cli.commands import main
sys.exit(main(sys.argv[1:]))
"""
WRITTEN = PEAK + """
import sys
from pathlib import Path
from resumerge import api
from resumerge.api.evolution import ApiCalls, SearchAsked, evolve_into
from resumerge.config.locations import StateDir
from resumerge.runs.evolve.search import SearchOptions
popsize = int(sys.argv[3])
asked = SearchAsked(sys.argv[1], Path(sys.argv[2]), SearchOptions(popsize - 1, popsize), api.Resources(),
                    StateDir.resolve())
evolve_into(asked, ApiCalls(api.run, api.plan_merge, api.open_population, api.evaluate), written=True)
"""


def _setup(work: Path, args: argparse.Namespace) -> Path:
    import yaml

    spec, new = parents.made([work / name for name in ("base", "a", "b")], args)
    for path in new if args.parent_vocab is not None else ():
        _full_tokenizer(path, args.vocab)
    tasks = []
    for number in range(args.tasks):
        texts = work / f"texts-{number}.txt" if number else work / "texts.txt"
        texts.write_text("".join(f"the {i} cat sat on the mat and looked at the {i + number + 1} dogs\n"
                                 for i in range(8)))
        if number == 0:
            tasks.append({"kl": {"parent": str(work / "a"), "texts": str(texts)}})
        elif number % 2:
            tasks.append({"nll": {"texts": str(texts)}})
        else:
            tasks.append({"kl": {"parent": str(work / "b"), "texts": str(texts)}})
    config = work / f"evolve-{args.tasks}.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"models": [str(work / "a"), str(work / "b")], "merge_method": "ties",
                   "base_model": str(work / "base"), "layer_granularity": 0},
        "tasks": tasks}))
    if args.parent_vocab is not None:
        other = _other_vocab(work, args.parent_vocab, spec)
        tasks[0] = {"kl": {"parent": str(other), "texts": tasks[0]["kl"]["texts"]}}
        (work / f"evolve-{args.tasks}-{args.parent_vocab}.yml").write_text(yaml.safe_dump({
            "genome": {"models": [str(work / "a"), str(work / "b")], "merge_method": "ties",
                       "base_model": str(work / "base"), "layer_granularity": 0},
            "tasks": tasks}))
    return config


def _full_tokenizer(folder: Path, vocab: int) -> None:
    """``folder``'s generated tokenizer made to hold ``vocab`` distinct tokens at ids 0 to ``vocab`` - 1 (the
    generator's repeats its two-letter pieces past 2,759, its ids then not contiguous): every two-letter piece once,
    then three-letter ones, so that a parent of another vocabulary shares as many tokens as a real one does."""
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens = [entry["content"] for entry in doc["added_tokens"]] + letters
    merges = []
    for piece in [x + y for x in letters for y in letters] + [x + y + z for x in letters for y in letters
                                                            for z in letters]:
        if len(tokens) >= vocab:
            break
        tokens.append(piece)
        merges.append(f"{piece[:-1]} {piece[-1]}")
    doc["model"]["vocab"], doc["model"]["merges"] = {t: i for i, t in enumerate(tokens)}, merges
    path.write_text(json.dumps(doc))


def _other_vocab(work: Path, kind: str, spec: ModelSpec) -> Path:
    """``a`` with another vocabulary (see the module's docstring), made once."""
    import dataclasses

    import torch
    from safetensors.torch import load_file, save_file

    from resumerge.cli.modelgen import make_model, write_tokenizer

    other = work / f"a-{kind}"
    if (other / "config.json").is_file():
        return other
    shutil.copytree(work / "a", other)
    rows = ("model.embed_tokens.weight", "lm_head.weight")
    if kind == "rows":  # a fine-tune with added tokens: a's rows, then new ones
        added = 128
        grown = make_model(work / "a-grown-tmp", dataclasses.replace(spec, vocab=spec.vocab + added), seed=9)
        new = {name: t[spec.vocab:] for f in grown.glob("*.safetensors") for name, t in load_file(str(f)).items()
               if name in rows}
        for shard in other.glob("*.safetensors"):
            tensors = load_file(str(shard))
            for name in rows:
                if name in tensors:
                    tensors[name] = torch.cat([tensors[name], new[name]]).contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
        shutil.rmtree(grown)
        config = json.loads((other / "config.json").read_text())
        config["vocab_size"] = spec.vocab + added
        (other / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(other, spec.vocab + added)
        _full_tokenizer(other, spec.vocab + added)
        return other
    doc = json.loads((other / "tokenizer.json").read_text())  # string: ids reversed, rows permuted alike
    vocab: dict[str, int] = doc["model"]["vocab"]
    plain = sorted((i, t) for t, i in vocab.items() if i >= 3)
    ids = [i for i, _ in plain]
    doc["model"]["vocab"] = {**{t: i for t, i in vocab.items() if i < 3},
                             **{t: i for (_, t), i in zip(plain, reversed(ids))}}
    (other / "tokenizer.json").write_text(json.dumps(doc))
    order = list(range(3)) + list(reversed(range(3, len(vocab))))
    for shard in other.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name in rows:
            if name in tensors:
                tensors[name] = tensors[name][order].contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return other


def _timed(argv: list[str], tree: Path, state: Path | None = None) -> tuple[float, float, int, str]:
    """(wall s, CPU s: user + system of the process and its children, peak RSS, stdout) of one fresh process
    (``state``: its state dir, where not the user's)."""
    wall, cpu, out = timed_run(argv, tree_env(tree, **({"RESUMERGE_STATE_DIR": str(state)} if state else {})))
    return wall, cpu, int(re.findall(r"^peak (\d+)$", out, re.M)[-1]), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parents.add_shape(parser)
    parser.add_argument("--popsize", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--base", type=Path, default=None, help="another tree's streamed search, alternated (A/B)")
    parser.add_argument("--max-memory", default=None)
    parser.add_argument("--streamed-only", action="store_true")
    parser.add_argument("--mergekit", action="store_true", help="also time mergekit-evolve's own loop")
    parser.add_argument("--lmeval", action="store_true",
                        help="mergekit's loop evaluates each candidate through lm-eval, as mergekit-evolve does")
    parser.add_argument("--parent-vocab", choices=("rows", "string"), default=None,
                        help="also time the search with the first kl parent of another vocabulary (step shared)")
    parser.add_argument("--only", nargs="+", default=None,
                        choices=("streamed", "base", "written", "mergekit", "shared"),
                        help="run only these steps (each holds the bench lock for less)")
    args = parser.parse_args()
    work = Path(tempfile.gettempdir()) / (f"bench-evolve-{args.layers}x{args.hidden}x{args.vocab}"
                                          + ("-full" if args.parent_vocab is not None else ""))
    work.mkdir(exist_ok=True)
    config = _setup(work, args)
    models = sum(f.stat().st_size for name in ("base", "a", "b") for f in (work / name).glob("*.safetensors"))
    steps = {"streamed": ROOT}
    if args.base is not None:
        steps["base"] = args.base.resolve()
    if not args.streamed_only:
        steps["written"] = ROOT
    if args.mergekit:
        steps["mergekit"] = ROOT
    if args.parent_vocab is not None:
        steps["shared"] = ROOT
    if args.only is not None:
        steps = {name: tree for name, tree in steps.items() if name in args.only}
    found: dict[str, list[tuple[float, float, int, tuple[float, ...]]]] = {name: [] for name in steps}
    tables: dict[str, bytes] = {}
    mergekit: list[dict[str, float]] = []
    budget = ["--max-memory", args.max_memory] if args.max_memory else []
    for run in range(args.runs):
        order = list(steps) if run % 2 == 0 else list(reversed(steps))
        for name in order:
            store = work / f"store-{name}"
            shutil.rmtree(store, ignore_errors=True)
            if name == "mergekit":
                argv = [sys.executable, str(ROOT / "bench" / "evolve_mergekit_loop.py"), str(work / "configs.json"),
                        str(config), str(work / "mergekit"), *(["--lmeval"] if args.lmeval else [])]
            elif name == "written":
                argv = [sys.executable, "-c", WRITTEN, str(config), str(store), str(args.popsize)]
            else:
                own = work / f"evolve-{args.tasks}-{args.parent_vocab}.yml" if name == "shared" else config
                argv = [sys.executable, "-c", STREAMED, "evolve", str(own), str(store), "--popsize",
                        str(args.popsize), "--max-fevals", str(args.popsize), *budget]
            load = os.getloadavg()
            # a search's first start: nothing its state dir keeps from the last run (a kl parent's texts' tokens)
            state = work / f"state-{name}" if args.parent_vocab is not None else None
            if state is not None:
                shutil.rmtree(state, ignore_errors=True)
            wall, cpu, peak, out = _timed(argv, steps[name], state)
            found[name].append((wall, cpu, peak, load))
            if name == "mergekit":
                mergekit = [json.loads(line)["tasks"] for line in out.splitlines() if line.startswith("{")]
            else:
                tables[name] = (store / "evaluations.jsonl").read_bytes()
            if name == "streamed" and not (work / "configs.json").is_file():
                configs = [json.loads(line)["config"] for line in tables[name].decode().splitlines()]
                (work / "configs.json").write_text(json.dumps(configs))
            print(f"run {run + 1} {name}: {wall:.1f} s wall, {cpu:.1f} CPU s, peak RSS {peak / 1e6:.0f} MB, load "
                  f"{load[0]:.1f}", flush=True)
    rows = {name: [json.loads(line) for line in table.decode().splitlines()] for name, table in tables.items()}
    for name, table in rows.items():
        if name == "shared":  # another parent: its own figures
            continue
        for ours, theirs in zip(rows.get("streamed", table), table, strict=True):
            for task, value in theirs["tasks"].items():
                assert abs(ours["tasks"][task] - value) <= 1e-6 * max(abs(value), 1e-3), (name, task, ours, theirs)
    best = {name: min(w for w, _, _, _ in runs) for name, runs in found.items()}
    cpu = {name: min(c for _, c, _, _ in runs) for name, runs in found.items()}
    summary = {"popsize": args.popsize, "tasks": args.tasks, "models_bytes": models, "max_memory": args.max_memory,
               "best_s": best, "best_cpu_s": cpu,
               "peak_rss": {name: max(p for _, _, p, _ in runs) for name, runs in found.items()}, "runs": found}
    if "base" in tables and "streamed" in tables:
        summary["identical_to_base"] = tables["base"] == tables["streamed"]
    if "base" in best and "streamed" in best:
        summary["ratio_base"] = best["streamed"] / best["base"]
        summary["cpu_ratio_base"] = cpu["streamed"] / cpu["base"]
    if "shared" in best and "streamed" in best:
        summary["ratio_shared"] = best["shared"] / best["streamed"]
        summary["cpu_ratio_shared"] = cpu["shared"] / cpu["streamed"]
    if "written" in best and "streamed" in best:
        summary["ratio"] = best["streamed"] / best["written"]
    if mergekit and "streamed" in best:
        summary["ratio_mergekit"] = best["streamed"] / best["mergekit"]
        summary["cpu_ratio_mergekit"] = cpu["streamed"] / cpu["mergekit"]
    # (lm-eval's figures are perplexities: only its time is compared)
    if mergekit and not args.lmeval and "streamed" in rows:
        summary["mergekit_largest_relative_difference"] = max(
            abs(ours["tasks"][k] - v) / max(abs(v), 1e-9)
            for ours, each in zip(rows["streamed"], mergekit, strict=True) for k, v in each.items())
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
