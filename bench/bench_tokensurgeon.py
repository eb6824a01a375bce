"""resumerge tokensurgeon beside mergekit-tokensurgeon 0.1.5 on one real pair: wall time, peak RSS (the process
tree's, sampled every 0.1 s) and whether the outputs agree.

    python bench/bench_tokensurgeon.py MODEL DONOR WORKDIR [-k 8] [-a omp] [--nice 19]

MODEL and DONOR are safetensors folders (a GGUF converted with resumerge itself: a passthrough config over it run
with --dequantize). Each tool runs once into WORKDIR/{resumerge,mergekit} (removed first), as a child process under
``nice``; the outputs are then compared tensor by tensor: the token embedding (and head) row by row, rows of tokens
both vocabularies hold must be equal, approximated rows within float tolerance (max |diff| printed), every other
tensor bit for bit. Prints one JSON document; issue 85's figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for each in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += each.memory_info().rss
    return total


def run(command: list[str], niceness: int) -> dict[str, float | int]:
    """Wall seconds and the process tree's peak RSS of ``command`` (exit status checked)."""
    started = time.perf_counter()
    child = subprocess.Popen(["nice", "-n", str(niceness), *command], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    proc, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, _tree_rss(proc))
        time.sleep(0.1)
    wall = time.perf_counter() - started
    err = child.stderr.read() if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({child.returncode}): {err[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20)}


def tensors(folder: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    found: dict[str, object] = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def compare(ours: Path, theirs: Path) -> dict[str, object]:
    import torch

    a, b = tensors(ours), tensors(theirs)
    report: dict[str, object] = {"same_names": sorted(a) == sorted(b)}
    worst, unequal = 0.0, []
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        if x.shape != y.shape:
            unequal.append(f"{name}: shapes {list(x.shape)} vs {list(y.shape)}")
            continue
        if torch.equal(x, y):
            continue
        diff = (x.float() - y.float()).abs()
        rows = (diff.reshape(diff.shape[0], -1).amax(dim=1) > 0).sum().item() if diff.dim() else 1
        worst = max(worst, diff.max().item())
        unequal.append(f"{name}: {rows} rows differ, max |diff| {diff.max().item():.3g}, "
                       f"scale {y.float().abs().max().item():.3g}")
    report["differ"] = unequal
    report["max_abs_diff"] = worst
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("donor")
    parser.add_argument("workdir")
    parser.add_argument("-k", type=int, default=64)
    parser.add_argument("-a", default="omp")
    parser.add_argument("--nice", type=int, default=19)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ours, theirs, state = work / "resumerge", work / "mergekit", work / "state"
    for folder in (ours, theirs, state):
        shutil.rmtree(folder, ignore_errors=True)
    options = ["-k", str(args.k), "-a", args.a]
    load = os.getloadavg()
    mergekit = run([shutil.which("mergekit-tokensurgeon") or "mergekit-tokensurgeon", args.model, args.donor,
                    str(theirs), *options, "--device", "cpu"], args.nice)
    resumerge = run([sys.executable, "-m", "resumerge", "tokensurgeon", args.model, args.donor, str(ours), *options,
                     "--state-dir", str(state), "--quiet"], args.nice)
    print(json.dumps({"model": args.model, "donor": args.donor, "options": options, "load_before": load,
                      "load_after": os.getloadavg(), "cpus": os.cpu_count(), "mergekit": mergekit,
                      "resumerge": resumerge,
                      "wall_ratio": round(resumerge["wall_s"] / mergekit["wall_s"], 2),
                      "rss_ratio": round(resumerge["peak_rss_mb"] / mergekit["peak_rss_mb"], 2),
                      "outputs": compare(ours, theirs)}, indent=2))


if __name__ == "__main__":
    main()
