"""``resumerge check`` killed and resumed against one uninterrupted, and a model twice ``--max-memory`` checked
under it.

Usage::

    python bench/bench_check_scale.py resume [--kill-at 15] [--tiled --layers 120 | --set --layers 64] [--work DIR]
    python bench/bench_check_scale.py budget [--layers 120] [--max-memory 900MB] [--work DIR]
    python bench/bench_check_scale.py start [--layers 120] [--runs 7] [--tree DIR]

``resume``: SmolLM2-135M-Instruct in float32 (tests/realmodel.py's fixture) checked against a parent with every
decoder-layer weight nudged (bench_check.py's), four short texts; the check is run whole, then run with
``RESUMERGE_KILL_AT=after_check_layer:N`` (SIGKILL after layer N-1 is journaled) and run again to finish; prints
each wall time, and the killed + resumed total against the whole one, and that the two reports are the same.
``--tiled``: the same with the ``budget`` mode's model (checked against its copy) instead. ``--set``: bench_check.py's
case, the merge of two parents of the ``--layers`` model checked against its base and both parents (four models;
``--layers 64``: the issue's ~1 GB model).

``budget``: a model made of SmolLM2's decoder layers repeated to ``--layers`` layers (its embeddings, norm and
tokenizer; 120 layers: 1.8 GB in float32) checked against a hard-linked copy of itself under ``--max-memory``;
prints the wall time and the child's peak RSS (``ru_maxrss``: file pages mapped while a tensor is cast included).
Each command runs in a fresh state dir, in a process of its own.

``start``: what a check's process does before its first layer, that a resumed check does again, timed in a fresh
interpreter ``--runs`` times: resumerge's imports as ``python -m resumerge check`` makes them, then torch, then the
``--layers`` model's modules built without weights (the native modules, or transformers imported and its modules
built: the line says which); ``--tree``: the resumerge checkout
whose code is timed (another worktree, to compare two trees on one machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_check import TEXTS, _make, _measured, tiled  # noqa: E402


def _check(model: Path, others: list[Path], texts: Path, state: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "resumerge", "check", str(model), *(a for p in others for a in ("--parent", str(p))),
            "--prompts", str(texts), "--json", "--state-dir", state, *extra]


def resume(args: argparse.Namespace, env: dict[str, str]) -> None:
    extra: list[str] = []
    if args.set:
        base, parents, merge = _make(args.work / f"set{args.layers}", 2, tiled(args.work, args.layers))
        extra = ["--base", str(base)]
        base = merge
    elif args.tiled:
        base, tiled_copy = _tiled(args)
        parents = [tiled_copy]
    else:
        _, parents, _ = _make(args.work, 1)
        from realmodel import smollm2_folder

        base = smollm2_folder()
    texts = args.work / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    whole_state = tempfile.mkdtemp(prefix="check-whole-")
    wall, peak, out = _measured(_check(base, parents, texts, whole_state, extra), env)
    whole = json.loads(out)
    print(f"uninterrupted: {wall:.1f} s, peak RSS {peak / 1e6:.0f} MB, verdict {whole['verdict']}")
    state = tempfile.mkdtemp(prefix="check-killed-")
    argv = _check(base, parents, texts, state, extra)
    start = time.perf_counter()
    killed = subprocess.run(argv, env={**env, "RESUMERGE_KILL_AT": f"after_check_layer:{args.kill_at}"},
                            capture_output=True, text=True)
    killed_wall = time.perf_counter() - start
    assert killed.returncode == -9, killed.stderr[-2000:]
    wall2, _, out2 = _measured(argv, env)
    doc = json.loads(out2)
    same = {k: v for k, v in doc.items() if k not in ("chart", "card")} == {
        k: v for k, v in whole.items() if k not in ("chart", "card")}
    print(f"killed after layer {args.kill_at - 1}: {killed_wall:.1f} s; resumed: {wall2:.1f} s; total "
          f"{killed_wall + wall2:.1f} s = {(killed_wall + wall2) / wall:.2f}x the uninterrupted check; "
          f"same report: {same}")


def _tiled(args: argparse.Namespace) -> tuple[Path, Path]:
    """SmolLM2's decoder layers repeated to ``--layers`` layers, and a hard-linked copy of it."""
    target = tiled(args.work, args.layers)
    copy = args.work / f"tiled{args.layers}-copy"
    if not copy.is_dir():
        copy.mkdir()
        for item in target.iterdir():
            os.link(item, copy / item.name)
    return target, copy


def budget(args: argparse.Namespace, env: dict[str, str]) -> None:
    target, copy = _tiled(args)
    size = (target / "model.safetensors").stat().st_size
    texts = args.work / "texts.txt"
    texts.write_text("\n".join(TEXTS[:2]) + "\n")
    argv = _check(target, [copy], texts, tempfile.mkdtemp(prefix="check-budget-"), ["--max-memory", args.max_memory])
    wall, peak, out = _measured(argv, env)
    doc = json.loads(out)
    print(f"{args.layers} layers, {size / 1e9:.2f} GB a model (2 read), --max-memory {args.max_memory}: {wall:.1f} s, "
          f"peak RSS {peak / 1e6:.0f} MB, verdict {doc['verdict']}, NLL {[round(m['nll'], 4) for m in doc['models']]}")


_START = """
import sys, time
t0 = time.perf_counter()
import resumerge.analyses.check.run, resumerge.cli.checkcmd
from resumerge.api.flagmap import executor_option
executor_option("local")
t1 = time.perf_counter()
from pathlib import Path
import torch
from resumerge.forward.engine.built import build_modules
t2 = time.perf_counter()
build_modules(Path(sys.argv[1]), torch.float32, what="bench")
t3 = time.perf_counter()
print(f"resumerge imports {t1 - t0:.2f} s, torch {t2 - t1:.2f} s, modules built {t3 - t2:.2f} s (transformers "
      f"imported: {'transformers' in sys.modules}), total {t3 - t0:.2f} s")
"""


def start(args: argparse.Namespace, env: dict[str, str]) -> None:
    target, _ = _tiled(args)
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, "-c", _START, str(target)], env={**env, "PYTHONPATH": str(args.tree)},
                              cwd=args.tree, capture_output=True, text=True, check=True)
        print(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("resume", "budget", "start"))
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--tiled", action="store_true", help="resume: check the --layers model against its copy")
    parser.add_argument("--set", action="store_true", help="resume: bench_check.py's case, a merge of two parents "
                        "of the --layers model checked against them and the base (--layers 64: the ~1 GB model)")
    parser.add_argument("--max-memory", default="900MB")
    parser.add_argument("--runs", type=int, default=7, help="start: how many fresh interpreters")
    parser.add_argument("--tree", type=Path, default=ROOT, help="start: the resumerge checkout timed")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "resumerge-bench-check")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    {"resume": resume, "budget": budget, "start": start}[args.mode](args, env)


if __name__ == "__main__":
    main()
