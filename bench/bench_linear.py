"""Side-by-side benchmark: linear merge of two ~1.74 GB fp32 Llama-style models, resumerge vs mergekit 0.1.5.

Usage: ``python bench/bench_linear.py [--runs N] [--work DIR] [--resumerge-args "..."] [--skip-mergekit]``

Generates the inputs once (hidden 2048, 16 layers, vocab 8000, 4 input shards: the shape of the measurements in
shared/reference/mergekit-semantics.md §10), then alternates runs of both tools on the same machine and prints
wall time and peak RSS (from ``wait4``, per child) for each, plus medians and ratios. Also times a ``resume``
of the finished merge and the disk floor (warm read of the inputs, fsynced write of the output size).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from launcher import launched

HERE = Path(__file__).resolve().parent
CONFIG = """merge_method: linear
models:
  - model: {a}
    parameters: {{weight: 0.5}}
  - model: {b}
    parameters: {{weight: 0.5}}
dtype: float32
"""


def run_measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int]:
    """Run ``argv``; return (wall seconds, peak RSS bytes of that command alone, exit code)."""
    done = launched(argv, env)
    if done.code != 0:
        sys.stderr.write(done.stderr[-2000:])
    return done.wall, done.peak_rss, done.code


def make_inputs(work: Path) -> tuple[Path, Path]:
    """Generate the two input models once (skipped when present)."""
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=16, hidden=2048, intermediate=1368, vocab=8000, heads=16, kv_heads=16,
                     shard_bytes=450_000_000, tokenizer=True)
    paths = []
    for name, seed in (("a", 1), ("b", 2)):
        path = work / name
        if not (path / "config.json").exists():
            print(f"generating {path} ...", flush=True)
            make_model(path, spec, seed=seed)
        paths.append(path)
    return paths[0], paths[1]


def read_floor(files: list[Path]) -> float:
    """Seconds of a warm read of ``files`` (each read once before, to warm the page cache)."""
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    start = time.monotonic()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.monotonic() - start


def write_floor(out_bytes: int, work: Path) -> float:
    """Seconds of an fsynced write of ``out_bytes`` (random, incompressible) to a file under ``work``, removed after."""
    target = work / "floor.bin"
    block = os.urandom(64 << 20)
    start = time.monotonic()
    with open(target, "wb") as fh:
        left = out_bytes
        while left > 0:
            fh.write(block[: min(left, len(block))])
            left -= len(block)
        fh.flush()
        os.fsync(fh.fileno())
    write = time.monotonic() - start
    target.unlink()
    return write


def disk_floor(inputs: list[Path], out_bytes: int, work: Path) -> tuple[float, float]:
    """(warm read seconds of every input model's safetensors files, fsynced write seconds of ``out_bytes``)."""
    return read_floor([p for d in inputs for p in d.glob("*.safetensors")]), write_floor(out_bytes, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--resumerge-args", default="", help="extra flags for resumerge run")
    parser.add_argument("--skip-mergekit", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    a, b = make_inputs(args.work)
    config = args.work / "linear.yml"
    config.write_text(CONFIG.format(a=a, b=b))
    mergekit = shutil.which("mergekit-yaml")
    results: dict[str, list[tuple[float, int]]] = {"resumerge": [], "mergekit": []}
    out_size = 0
    for run in range(args.runs):
        for tool in ("resumerge", "mergekit"):
            if tool == "mergekit" and (args.skip_mergekit or mergekit is None):
                continue
            out = args.work / f"out-{tool}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(args.work / "state", ignore_errors=True)
            if tool == "resumerge":
                argv = [sys.executable, "-m", "resumerge", "run", str(config), str(out), "--quiet",
                        "--state-dir", str(args.work / "state"), *shlex.split(args.resumerge_args)]
            else:
                argv = [str(mergekit), str(config), str(out), "--random-seed", "0", "--quiet"]
            argv[0] = shutil.which(argv[0]) or argv[0]
            wall, rss, code = run_measured(argv, env=dict(os.environ, PYTHONHASHSEED="0"))
            if code != 0:
                raise SystemExit(f"{tool} failed with exit code {code}")
            out_size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
            results[tool].append((wall, rss))
            print(f"run {run + 1} {tool:9s} wall {wall:6.2f} s  peak RSS {rss / 1e6:7.0f} MB  "
                  f"output {out_size / 1e9:.3f} GB", flush=True)
    resume_wall, resume_rss, _ = run_measured(
        [sys.executable, "-m", "resumerge", "resume", str(args.work / "out-resumerge"), "--quiet",
         "--state-dir", str(args.work / "state")])
    read, write = disk_floor([a, b], out_size, args.work)
    print()
    print("| tool | median wall s | median peak RSS MB |")
    print("|---|---|---|")
    for tool, rows in results.items():
        if rows:
            print(f"| {tool} | {statistics.median(r[0] for r in rows):.2f} | "
                  f"{statistics.median(r[1] for r in rows) / 1e6:.0f} |")
    if results["mergekit"] and results["resumerge"]:
        ratio = statistics.median(r[0] for r in results["resumerge"]) / statistics.median(
            r[0] for r in results["mergekit"])
        rss_ratio = statistics.median(r[1] for r in results["resumerge"]) / statistics.median(
            r[1] for r in results["mergekit"])
        print(f"\nresumerge / mergekit: wall {ratio:.2f}x, peak RSS {rss_ratio:.2f}x")
    print(f"resume of the finished merge (verifies every file): {resume_wall:.2f} s, {resume_rss / 1e6:.0f} MB")
    print(f"disk floor: warm read of inputs {read:.2f} s, fsynced write of {out_size / 1e9:.2f} GB {write:.2f} s")


if __name__ == "__main__":
    main()
