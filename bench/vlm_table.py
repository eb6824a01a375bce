"""Multimodal (VLM) merges, resumerge vs mergekit 0.1.5: family × layout × method → loads / tensors / equal.

Usage::

    python bench/vlm_table.py [--methods linear,slerp,ties,passthrough] [--work DIR]

Builds the tiny VLMs of tests/vlm_families.py (Llava in three layouts, Gemma 3 in two, Qwen2-VL, Qwen2.5-VL,
Mistral 3, Idefics3), merges each pair with every method through ``resumerge`` (in this process) and
``mergekit-yaml`` (all configs in one subprocess, through its Python API), and prints one markdown row per case:
whether each output loads with the family's class (no missing or unexpected key, finite logits on a dummy image
+ text), how many of the input's tensors each wrote, and whether the two outputs are tensor-equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import output_tensors
from vlm_families import VLMS, inputs, make_vlm, model_class, vlm

from resumerge import api

LAYOUTS = [(f.name, layout) for f in VLMS for layout in ("saved", *(("hub",) if f.hub_prefixes else ()))]
LAYOUTS.insert(1, ("llava", "memory"))
_MERGEKIT = """
import json, sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
out = {}
for name, config, target in json.loads(sys.argv[1]):
    try:
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(config))), target,
                  MergeOptions(quiet=True, random_seed=0, copy_tokenizer=False))
        out[name] = "ok"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: ...{' '.join(str(exc).split())[-60:]}"
print(json.dumps(out))
"""


def _doc(method: str, a: Path, b: Path) -> dict[str, Any]:
    if method == "passthrough":
        return {"merge_method": method, "dtype": "float32", "models": [{"model": str(a)}]}
    models = [{"model": str(a), "parameters": {"weight": 0.4, "density": 0.5}},
              {"model": str(b), "parameters": {"weight": 0.6, "density": 0.5}}]
    doc: dict[str, Any] = {"merge_method": method, "dtype": "float32", "models": models}
    if method in ("slerp", "ties"):
        doc["base_model"] = str(a)
    if method == "slerp":
        doc["models"] = [{"model": str(a)}, {"model": str(b)}]
        doc["parameters"] = {"t": [0.0, 0.5]}
    return doc


def _loads(family: str, out: Path) -> str:
    try:
        model, info = model_class(vlm(family)).from_pretrained(out, output_loading_info=True)
        problems = {k: len(v) for k, v in info.items() if v}
        if problems:
            return "no: " + ", ".join(f"{n} {k}" for k, n in problems.items())
        with torch.no_grad():
            logits = model(**inputs(vlm(family), model)).logits
        return "yes" if bool(torch.isfinite(logits).all()) else "no: non-finite logits"
    except Exception as exc:  # a report, not a test: say what failed
        return f"no: {type(exc).__name__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="linear,slerp,ties,passthrough")
    parser.add_argument("--work", default=None, help="working directory [default: a temp dir]")
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    root = Path(args.work or tempfile.mkdtemp(prefix="vlm-table-"))
    methods = args.methods.split(",")
    jobs, rows = [], []
    for name, layout in LAYOUTS:
        a, b = (make_vlm(root / f"{name}-{layout}-{s}", vlm(name), s, layout) for s in range(2))
        for method in methods:
            key = f"{name}-{layout}-{method}"
            cfg = root / f"{key}.yml"
            cfg.write_text(yaml.safe_dump(_doc(method, a, b), sort_keys=False))
            api.run(cfg, root / f"{key}-ours", settings=api.Settings(state_dir=root / "state"))
            jobs.append((key, str(cfg), str(root / f"{key}-theirs")))
            rows.append((name, layout, method, key, len(output_tensors(a))))
    done = subprocess.run([sys.executable, "-c", _MERGEKIT, json.dumps(jobs)], capture_output=True, text=True,
                          check=False, env={**_env(), "PYTHONHASHSEED": "0"})
    results = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
    print("| family | layout | method | resumerge loads | resumerge tensors | mergekit | mergekit loads | "
          "mergekit tensors | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, layout, method, key, total in rows:
        ours, theirs_dir = output_tensors(root / f"{key}-ours"), root / f"{key}-theirs"
        result = results.get(key, "not run")
        theirs = output_tensors(theirs_dir) if result == "ok" else {}
        equal = ("yes" if ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
                 else "no" if theirs else "—")
        print(f"| {name} | {layout} | {method} | {_loads(name, root / f'{key}-ours')} | {len(ours)}/{total} | "
              f"{'exit 0' if result == 'ok' else result} | {_loads(name, theirs_dir) if theirs else '—'} | "
              f"{len(theirs)}/{total} | {equal} |")
    print(f"\n`python bench/vlm_table.py --methods {args.methods}` (work dir {root})")


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


if __name__ == "__main__":
    main()
