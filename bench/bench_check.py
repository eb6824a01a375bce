"""``resumerge check`` next to the peer: transformers loading each model whole and running the same tokens.

Usage::

    python bench/bench_check.py [--parents 2] [--max-memory SIZE] [--work DIR] [--runs N] [--no-peer]
                                [--peer-passive] [--layers N]
                                [--checkout TREE]

Takes SmolLM2-135M-Instruct in float32 (tests/realmodel.py's fixture, 0.54 GB) as the base, makes ``--parents``
parents (every decoder-layer weight nudged under a seed) and a merge (their mean) in ``--work``, then runs,
alternating, ``--runs`` times each: ``resumerge check MERGE --base BASE --parent P... --prompts TEXTS --json`` in
a fresh state dir, and a peer script that loads each model whole with ``AutoModelForCausalLM.from_pretrained`` and
computes the same NLLs and KLs (all log-probabilities held). Prints each run's wall time and the peak RSS of its
process (``ru_maxrss`` of the child), and the NLLs both found. ``--layers 64``: the base is SmolLM2's decoder
layers repeated to 64 (1.02 GB in float32; the issue's "~1 GB model"), its parents and merge made from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "The derivative of x squared is two x, and the integral of two x is x squared plus a constant.",
         "Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville."]
PEER = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
paths, texts = json.loads(sys.argv[1]), open(sys.argv[2]).read().splitlines()
tok = AutoTokenizer.from_pretrained(paths[0])
seqs = [torch.tensor([tok(t)["input_ids"]]) for t in texts if t.strip()]
lps = []
with torch.no_grad():
    for p in paths:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        lps.append([torch.log_softmax(model(input_ids=s).logits[0, :-1], -1) for s in seqs])
        del model
n = sum(s.shape[1] - 1 for s in seqs)
nll = [sum(float(-lp.gather(-1, s[0, 1:, None]).sum()) for lp, s in zip(m, seqs)) / n for m in lps]
kl = [sum(float((o.exp() * (o - mm)).sum()) for o, mm in zip(m, lps[0])) / n for m in lps[1:]]
print(json.dumps({"nll": nll, "kl": kl}))
"""


def tiled(work: Path, layers: int) -> Path:
    """SmolLM2's decoder layers repeated to ``layers`` layers (its embeddings, norm and tokenizer): 64 layers
    are 1.02 GB in float32, 120 layers 1.81 GB."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from realmodel import smollm2_folder
    from safetensors.torch import load_file, save_file

    base = smollm2_folder()
    target = work / f"tiled{layers}"
    if not (target / "model.safetensors").is_file():
        target.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(base / "model.safetensors"))
        config = json.loads((base / "config.json").read_text())
        count = int(config["num_hidden_layers"])
        state: dict[str, torch.Tensor] = {k: t for k, t in tensors.items() if not k.startswith("model.layers.")}
        for index in range(layers):
            prefix = f"model.layers.{index % count}."
            for name, t in tensors.items():
                if name.startswith(prefix):
                    state[f"model.layers.{index}.{name[len(prefix):]}"] = t.clone()
        for item in base.iterdir():
            if item.name not in ("model.safetensors", "config.json") and not (target / item.name).exists():
                os.link(item, target / item.name)
        config["num_hidden_layers"] = layers
        (target / "config.json").write_text(json.dumps(config, indent=2))
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _make(work: Path, parents: int, base: Path | None = None) -> tuple[Path, list[Path], Path]:
    """``parents`` parents of ``base`` (SmolLM2-135M-Instruct in float32 when None) and the merge (their mean)
    in ``work``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from realmodel import smollm2_folder
    from safetensors.torch import load_file, save_file

    base = smollm2_folder() if base is None else base
    tensors = load_file(str(base / "model.safetensors"))
    made, states = [], []
    for seed in range(parents):
        target = work / f"parent{seed}"
        generator = torch.Generator().manual_seed(seed)
        state = {k: (t + 0.05 * t.std() * torch.randn(t.shape, generator=generator))
                 if ".layers." in k and t.dim() == 2 else t for k, t in tensors.items()}
        states.append(state)
        made.append(_save(base, target, state, save_file))
    merge = {k: sum(s[k] for s in states) / len(states) for k in tensors}
    return base, made, _save(base, work / "merge", merge, save_file)


def _save(base: Path, target: Path, state: dict, save_file: object) -> Path:
    if not (target / "model.safetensors").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for item in base.iterdir():
            if item.name != "model.safetensors" and not (target / item.name).exists():
                os.link(item, target / item.name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"),  # type: ignore[operator]
                  metadata={"format": "pt"})
    return target


def _measured(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of ``argv``, run under a wrapper process of its own (so that
    ``ru_maxrss`` of its children is this command's alone)."""
    runner = [sys.executable, "-c", "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]);"
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(done.returncode)",
              *argv]
    start = time.perf_counter()
    done = subprocess.run(runner, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 5, 6):
        raise SystemExit(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    *out, peak = done.stdout.strip().splitlines()
    return wall, int(peak), "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parents", type=int, default=2)
    parser.add_argument("--max-memory", default=None)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "resumerge-bench-check")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="time the check alone")
    parser.add_argument("--peer-passive", action="store_true", help="run the peer a second time with "
                        "OMP_WAIT_POLICY=PASSIVE, as the check sets it for itself")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the resumerge tree whose check is timed")
    parser.add_argument("--layers", type=int, default=None, help="SmolLM2's layers repeated to this many "
                        "(64: a 1.02 GB model) as the base, instead of SmolLM2 itself")
    args = parser.parse_args()
    work = args.work if args.layers is None else args.work / f"set{args.layers}"
    base, parents, merge = _make(work, args.parents, None if args.layers is None else tiled(args.work, args.layers))
    texts = work / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    env = {**os.environ, "PYTHONPATH": str(args.checkout)}
    for run in range(args.runs):
        state = tempfile.mkdtemp(prefix="check-state-")
        # -P: the tree on PYTHONPATH is the one timed (``-m`` would put the working directory first on the path)
        argv = [sys.executable, "-P", "-m", "resumerge", "check", str(merge), "--base", str(base),
                *(a for p in parents for a in ("--parent", str(p))), "--prompts", str(texts), "--json",
                "--state-dir", state, *(["--max-memory", args.max_memory] if args.max_memory else [])]
        try:
            wall, peak, out = _measured(argv, env)
        finally:  # the check's state dir (journal, report, records): none left behind
            shutil.rmtree(state, ignore_errors=True)
        doc = json.loads(out)
        print(f"run {run}: check {wall:.1f} s, peak RSS {peak / 1e6:.0f} MB, verdict {doc['verdict']}, "
              f"NLL {[round(m['nll'], 4) for m in doc['models']]}, KL {[m['kl'] for m in doc['models'][1:]]}")
        if args.no_peer:
            continue
        peer = [sys.executable, "-c", PEER, json.dumps([str(merge), str(base), *map(str, parents)]), str(texts)]
        wall, peak, out = _measured(peer, env)
        print(f"run {run}: peer  {wall:.1f} s, peak RSS {peak / 1e6:.0f} MB, {out}")
        if args.peer_passive:
            wall, peak, out = _measured(peer, {**env, "OMP_WAIT_POLICY": "PASSIVE"})
            print(f"run {run}: peer, OMP_WAIT_POLICY=PASSIVE  {wall:.1f} s, peak RSS {peak / 1e6:.0f} MB, {out}")

if __name__ == "__main__":
    main()
