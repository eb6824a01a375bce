"""resumerge tokensurgeon beside mergekit-tokensurgeon 0.1.5 on one real pair: wall time, CPU seconds (user +
system of the process and the children it waited for), peak RSS (the process tree's, sampled every 0.1 s) and
whether the outputs agree.

    python bench/bench_tokensurgeon.py MODEL DONOR WORKDIR [-k 8] [-a omp] [--nice 19] [--runs 3]
        [--baseline TREE]

``--runs N`` alternates the tools run by run (mergekit, resumerge, the baseline, mergekit, …) and prints each run
and the medians, so that a shared machine's drift falls on all of them; ``--baseline TREE`` also times resumerge
from another checkout (``git archive`` of main, say: PYTHONPATH=TREE) and checks that its output is the same bytes.
On a loaded machine compare the CPU seconds: the walls follow the other jobs.

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
import statistics
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


def run(command: list[str], niceness: int, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> dict[str, float | int]:
    """Wall seconds, CPU seconds and the process tree's peak RSS of ``command`` (exit status checked)."""
    started = time.perf_counter()
    child = subprocess.Popen(["nice", "-n", str(niceness), *command], stdout=subprocess.DEVNULL, cwd=cwd,
                             stderr=subprocess.PIPE, text=True, env=env)
    proc, peak = psutil.Process(child.pid), 0
    usage = None
    while usage is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, _tree_rss(proc))
        pid, status, used = os.wait4(child.pid, os.WNOHANG)
        if pid:
            usage, child.returncode = used, os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.1)
    wall = time.perf_counter() - started
    err = child.stderr.read() if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({child.returncode}): {err[-2000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mb": round(peak / 2**20)}


def _median(runs: list[dict[str, float | int]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}


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
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--baseline", help="another resumerge checkout to time alternately (PYTHONPATH=TREE)")
    args = parser.parse_args()
    # Absolute paths: each resumerge runs from its own tree (`python -m` puts the working directory first on
    # sys.path, ahead of PYTHONPATH, so a baseline started from this checkout imported this checkout's code).
    args.model, args.donor = str(Path(args.model).resolve()), str(Path(args.donor).resolve())
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ours, theirs, base = work / "resumerge", work / "mergekit", work / "baseline"
    options = ["-k", str(args.k), "-a", args.a]
    load = os.getloadavg()
    tools: dict[str, tuple[list[str], Path, dict[str, str] | None]] = {
        "mergekit": ([shutil.which("mergekit-tokensurgeon") or "mergekit-tokensurgeon", args.model, args.donor,
                      str(theirs), *options, "--device", "cpu"], theirs, None)}
    for name, folder, tree in (("resumerge", ours, None), ("baseline", base, args.baseline)):
        if name == "baseline" and tree is None:
            continue
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())} if tree else None
        tools[name] = ([sys.executable, "-m", "resumerge", "tokensurgeon", args.model, args.donor, str(folder),
                        *options, "--state-dir", str(work / f"state-{name}"), "--quiet"], folder, env)
    runs: dict[str, list[dict[str, float | int]]] = {name: [] for name in tools}
    for _ in range(args.runs):
        for name, (command, folder, env) in tools.items():
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(work / f"state-{name}", ignore_errors=True)
            home = Path(args.baseline).resolve() if name == "baseline" else Path(__file__).resolve().parents[1]
            runs[name].append(run(command, args.nice, env, cwd=home if name != "mergekit" else None))
            print(name, runs[name][-1], file=sys.stderr, flush=True)  # each run as it ends: a later failure keeps it
    median = {name: _median(each) for name, each in runs.items()}
    report: dict[str, object] = {
        "model": args.model, "donor": args.donor, "options": options, "load_before": load,
        "load_after": os.getloadavg(), "cpus": os.cpu_count(), "runs": runs, "median": median,
        "ratio_to_mergekit": {key: round(median["resumerge"][key] / median["mergekit"][key], 2)
                              for key in ("wall_s", "cpu_s", "peak_rss_mb")},
        "outputs": compare(ours, theirs)}
    if "baseline" in median:
        report["ratio_to_baseline"] = {key: round(median["resumerge"][key] / median["baseline"][key], 2)
                                       for key in ("wall_s", "cpu_s", "peak_rss_mb")}
        report["baseline_outputs_identical"] = all(
            (base / f.name).read_bytes() == f.read_bytes() for f in ours.glob("*.safetensors"))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
