"""MoE upcycling with hidden-state gates: ``resumerge run`` next to ``mergekit-moe`` on generated Llamas.

Usage::

    python bench/bench_moe.py [--size 1.7GB] [--experts 2] [--max-memory 1GB] [--work DIR] [--skip-mergekit]
                              [--runs N] [--estimate]

Generates float32 Llama-style models of about ``--size`` bytes (the base and the experts; kept in ``--work``,
shared with bench_vs_mergekit.py), writes a ``gate_mode: hidden`` config over them, and runs it through
``resumerge run`` (with ``--max-memory SIZE``; ``--max-memory default`` leaves the default budget) and
``mergekit-moe`` (its default device, cpu), alternating, ``--runs`` times each with a fresh OUT and state dir,
after reading every input once (so that neither tool's first run meets a cold page cache), reporting each run's
wall time, the peak of its whole process tree (RSS and PSS summed over the process and its
children, sampled every 20 ms: resumerge runs the prompt forward pass in a child process) and output bytes, the
load average, and whether every output tensor has the same bits. ``--estimate`` first prints what ``resumerge
plan`` expects (wall, peak).
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
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_vs_mergekit import make_inputs  # noqa: E402

from resumerge.machine.memory.sizes import format_size, parse_size  # noqa: E402

PROMPTS = (["ab cd ef gh", "Ab Cd Ef"], ["zz yy xx", "Zq rs tu vw"], ["mn op qr", "st uv"])


def _config(models: list[Path], experts: int) -> str:
    lines = [f"base_model: {models[0]}", "gate_mode: hidden", "dtype: bfloat16", "experts:"]
    for i in range(experts):
        lines += [f"  - source_model: {models[1 + i % (len(models) - 1)]}", "    positive_prompts:"]
        lines += [f"      - {p!r}" for p in PROMPTS[i % len(PROMPTS)]]
    return "\n".join(lines) + "\n"


def _same_bits(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def load(d: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(shard)))
        return out

    x, y = load(a), load(b)
    return sorted(x) == sorted(y) and all(torch.equal(x[k].view(torch.int16), y[k].view(torch.int16)) for k in x)


@dataclass(frozen=True)
class TreeMeasure:
    """One command: wall seconds, and the peak of its process tree's summed RSS and PSS (sampled)."""

    wall: float
    rss: int
    pss: int


def run_tree(argv: list[str]) -> TreeMeasure:
    """Run ``argv`` (in the repository root) and sample its process tree until it ends."""
    peak_rss = peak_pss = 0
    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = pss = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    info = p.memory_full_info()
                    rss, pss = rss + info.rss, pss + info.pss
            except psutil.Error:
                pass
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.02)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{err.read().decode()[-3000:]}")
    return TreeMeasure(wall, peak_rss, peak_pss)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7GB")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--max-memory", default="1GB")
    parser.add_argument("--work", default=str(ROOT / "bench" / "work"))
    parser.add_argument("--models", help="reuse these model folders (base first) instead of generating them")
    parser.add_argument("--skip-mergekit", action="store_true")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--estimate", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.models:
        models = [Path(m) for m in args.models.split(",")]
        exact = sum(p.stat().st_size for p in models[0].glob("*.safetensors"))
    else:
        models, exact = make_inputs(work, parse_size(args.size, option="--size"))
    config = work / f"moe-{exact}-{args.experts}.yml"
    config.write_text(_config(models, args.experts))
    outs = {"resumerge": work / "moe-out-resumerge", "mergekit-moe": work / "moe-out-mergekit"}
    budget = [] if args.max_memory == "default" else ["--max-memory", args.max_memory]
    runs = {"resumerge": [sys.executable, "-m", "resumerge", "run", str(config), str(outs["resumerge"]),
                          "--state-dir", str(work / "moe-state"), *budget, "--quiet"]}
    if not args.skip_mergekit:
        runs["mergekit-moe"] = [shutil.which("mergekit-moe") or "mergekit-moe", str(config),
                                str(outs["mergekit-moe"])]
    print(f"models {format_size(exact)} each, {args.experts} experts, gate_mode hidden, bfloat16 output, "
          f"resumerge budget {args.max_memory}")
    if args.estimate:  # of a first run: an earlier run's output would be found finished (same fingerprint)
        shutil.rmtree(work / "moe-state", ignore_errors=True)
        shutil.rmtree(outs["resumerge"], ignore_errors=True)
        plan = subprocess.run([sys.executable, "-m", "resumerge", "plan", str(config), str(outs["resumerge"]),
                               "--state-dir", str(work / "moe-state"), *budget, "--json"], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        doc = json.loads(plan.stdout)
        when = "beside the merge" if doc["time"]["prepass_beside"] else "before the merge"
        print(f"plan: {doc['time']['seconds']} s (start-up {doc['time']['startup_seconds']} s, pass "
              f"{doc['time']['prepass_seconds']} s {when}, its CPU {doc['time']['prepass_cpu_seconds']:.1f} s, cores "
              f"left by others {doc['time']['cores_available']}), peak {format_size(doc['memory']['peak_bytes'])} "
              f"(pass's process {format_size(doc['memory']['prepass_bytes'])}), load {_load()}")
    for path in sorted({f for m in models for f in m.glob("*.safetensors")}):  # a warm page cache for both tools
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    print("| tool | wall | tree peak RSS | tree peak PSS | output | load |")
    for _ in range(args.runs):
        for tool, argv in runs.items():
            shutil.rmtree(outs[tool], ignore_errors=True)
            shutil.rmtree(work / "moe-state", ignore_errors=True)
            load = _load()
            m = run_tree(argv)
            size = sum(p.stat().st_size for p in outs[tool].glob("*.safetensors"))
            print(f"| {tool} | {m.wall:.1f} s | {format_size(m.rss)} | {format_size(m.pss)} | {format_size(size)} "
                  f"| {load} |", flush=True)
    if not args.skip_mergekit:
        print("same tensors, same bits:", _same_bits(outs["resumerge"], outs["mergekit-moe"]))


if __name__ == "__main__":
    main()
