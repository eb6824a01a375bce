"""A merge of two hub GGUFs, per fetch mode, against the same merge of the local files (issue 58).

Usage: ``python bench/bench_hub_gguf.py [--work DIR] [--layers N] [--runs N]``

Generates two llama Q8_0 GGUFs once under ``--work`` with ``bench_gguf.make_input`` (``bench/work/`` is ignored
by git; 8 layers: ~0.52 GB each) and serves them from the stand-in hub of ``tests/hub`` (in this process, on
127.0.0.1, no simulated link: loopback), mapped from disk as ``bench/a`` and ``bench/b``. Each row is one
``resumerge run`` (a fresh process) of a linear 0.5/0.5 merge with ``--out-type gguf --gguf-type q8_0``:

- ``local``: the local files;
- ``download``: the hub GGUFs from an empty HF cache, the default (downloaded while merging, verified);
- ``stream``: the same with ``--stream-inputs`` (tensors by HTTP Range, nothing in the cache);
- ``max-disk``: the same without the flag but ``--max-disk`` too small for the downloads (so streamed);
- ``cached``: again after ``download``, the cache holding both files (verified there: no byte fetched).

Reported: wall, CPU seconds and peak RSS of the run's processes; the body bytes the stand-in served for the two
files against their sizes (goal: each byte fetched once), in how many requests; whether the output equals the local
run's byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT)]

from bench_gguf import make_input  # noqa: E402
from hub.fakehub import FakeHub, SparseFile, iter_requests  # noqa: E402

_LAUNCHER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(code, u.ru_maxrss, u.ru_utime + u.ru_stime)
"""
FILE = "model.Q8_0.gguf"


def measured(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Run ``argv``: (wall s, CPU s of it and its children, peak RSS MB of the largest of them)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True, check=False,
                          env=env)
    wall = time.monotonic() - start
    code, peak, cpu = done.stdout.split()[-3:]
    if int(code) != 0:
        sys.exit(f"{argv[3:6]} failed:\n{done.stderr[-3000:]}")
    return wall, float(cpu), int(peak) // 1024


def _over(served: int, total: int) -> str:
    """The bytes served against the files' bytes: the ratio, and the bytes over them."""
    return f"{served / total:.4f}x, {served - total:+d} B" if served else "none"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=HERE / "work" / "hub-gguf")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    inputs = {"bench/a": work / "a.gguf", "bench/b": work / "b.gguf"}
    for seed, path in enumerate(inputs.values(), 1):
        if not path.exists():
            print(f"generating {path} ...", flush=True)
            make_input(path.with_suffix(".part"), args.layers, seed)
            path.with_suffix(".part").rename(path)
    sizes = {repo: path.stat().st_size for repo, path in inputs.items()}
    total = sum(sizes.values())
    hub = FakeHub()
    for repo, path in inputs.items():  # mapped from disk, hashed whole: the listed sha256 is the real one
        hub.push(repo, {FILE: SparseFile.open(path, hashed_below=1 << 40), "README.md": b"# bench\n"})
    configs = {}
    for name, refs in (("local", [str(p) for p in inputs.values()]), ("hub", [f"{r}/{FILE}" for r in inputs])):
        configs[name] = work / f"{name}.yml"
        configs[name].write_text("merge_method: linear\ndtype: float32\nmodels:\n" + "".join(
            f"  - model: {ref}\n    parameters: {{weight: 0.5}}\n" for ref in refs))
    out_flags = ["--out-type", "gguf", "--gguf-type", "q8_0", "--quiet"]
    print(f"inputs: 2 x {total / 2 / 1e9:.3f} GB Q8_0 ({args.layers} layers); load average {os.getloadavg()}",
          flush=True)
    rows: dict[str, list[tuple[float, float, int, int, int, bool]]] = {}
    with hub:
        for _ in range(args.runs):
            want = ""
            plan = [("local", []), ("download", []), ("cached", []), ("stream", ["--stream-inputs"]),
                    ("max-disk", ["--max-disk", f"{int(total * 0.8)}"])]
            for label, flags in plan:
                out, state = work / f"out-{label}", work / f"state-{label}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(state, ignore_errors=True)
                cache = work / ("cache-download" if label in ("download", "cached") else f"cache-{label}")
                if label != "cached":
                    shutil.rmtree(cache, ignore_errors=True)
                env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(work / "hf_home"),
                       "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
                env.pop("HF_TOKEN", None)
                hub.reset_counters()
                config = configs["local" if label == "local" else "hub"]
                wall, cpu, peak = measured([sys.executable, "-m", "resumerge", "run", str(config), str(out),
                                            "--state-dir", str(state), *out_flags, *flags], env)
                served = sum(v for k, v in hub.file_bytes().items() if k.endswith(".gguf"))
                requests = sum(1 for r in iter_requests(hub, "GET") if r.sent and r.path.endswith(".gguf"))
                digest = sha256(out / "model.gguf")
                want = want or digest
                rows.setdefault(label, []).append((wall, cpu, peak, served, requests, digest == want))
                print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU, {peak} MB peak, served {served} bytes "
                      f"({_over(served, total)}) in {requests} requests", flush=True)
    print(f"\nload average after: {os.getloadavg()}")
    print("| run | median wall s (each) | CPU s | peak RSS MB | served by the hub (x the files' bytes, over them) | "
          "GET bodies | output = local's |\n|---|---|---|---|---|---|---|")
    for label, got in rows.items():
        wall = statistics.median(r[0] for r in got)
        print(f"| {label} | {wall:.1f} ({', '.join(f'{r[0]:.1f}' for r in got)}) | "
              f"{statistics.median(r[1] for r in got):.1f} | {max(r[2] for r in got)} | "
              f"{got[-1][3] / 1e6:.1f} MB ({_over(got[-1][3], total)}) | {got[-1][4]} | "
              f"{all(r[5] for r in got)} |")


if __name__ == "__main__":
    main()
