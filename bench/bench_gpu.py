"""``--device cuda`` against the CPU on the same machine: wall time, peak RSS and whether the outputs agree.

Usage (on a machine with a CUDA GPU)::

    python bench/bench_gpu.py [--size 600MB] [--work DIR] [--methods linear,ties,tsv,...] [--gguf q8_0,q4_0]

Generates (once per size, kept in ``--work``) three Llama-style float32 models with ``bench_vs_mergekit.py``'s
generator, then for each method merges the second and third onto the first once on the CPU and once with
``--device cuda``, each a fresh ``resumerge run`` process measured by that bench's launcher, and compares every
output tensor: ``bytes`` where the two outputs are the same file for file, else the largest difference relative to
the tensor's largest value (GPU sums may round differently in the last bit). ``--gguf T`` adds linear merges written
as ``--out-type gguf --gguf-type T`` (compared by the decoded values: a last-bit change may move a code one step).
Prints markdown rows for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_vs_mergekit import make_inputs, run_measured  # noqa: E402

from resumerge.machine.checksums import hash_file  # noqa: E402
from resumerge.machine.memory.sizes import parse_size  # noqa: E402

METHODS = ("linear", "ties", "della", "karcher", "iso_c", "tsv")
BASED = {"ties", "della", "tsv", "iso_c", "iso_cts", "task_arithmetic", "dare_ties"}


def config_text(method: str, models: list[Path]) -> str:
    base, others = models[0], models[1:]
    params = {"ties": "{weight: 0.5, density: 0.5}", "della": "{weight: 0.5, density: 0.5, epsilon: 0.1}"}
    if method in BASED:
        body = "".join(f"\n  - model: {p}" + (f"\n    parameters: {params[method]}" if method in params else "")
                       for p in others)
        head = f"merge_method: {method}\nbase_model: {base}\n"
    else:
        weight = "\n    parameters: {weight: 0.5}" if method == "linear" else ""
        body = "".join(f"\n  - model: {p}{weight}" for p in others)
        head = f"merge_method: {method}\n"
    return f"{head}dtype: float32\nmodels:{body}\n"


def compare(cpu: Path, gpu: Path) -> str:
    files = sorted(p.name for p in cpu.iterdir() if p.suffix in (".safetensors", ".gguf"))
    if all((gpu / f).exists() and hash_file(cpu / f) == hash_file(gpu / f) for f in files):
        return "bytes"
    import torch

    if files and files[0].endswith(".gguf"):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        worst = 0.0
        a, b = GGUFReader(cpu / files[0]), GGUFReader(gpu / files[0])
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            va = torch.from_numpy(dequantize(ta.data, ta.tensor_type).astype("float32"))
            vb = torch.from_numpy(dequantize(tb.data, tb.tensor_type).astype("float32"))
            scale = float(va.abs().max()) or 1.0
            worst = max(worst, float((va - vb).abs().max()) / scale)
        return f"max rel diff {worst:.2e} (codes)"
    from safetensors.torch import load_file

    worst = 0.0
    for f in files:
        fa, fb = load_file(cpu / f), load_file(gpu / f)
        for key, t in fa.items():
            t, u = t.float(), fb[key].float()
            scale = float(t.abs().max()) or 1.0
            worst = max(worst, float((t - u).abs().max()) / scale)
    return f"max rel diff {worst:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="600MB")
    parser.add_argument("--work", default="bench-work")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--gguf", default="q8_0,q4_0")
    parser.add_argument("--resumerge-args", default="", help="more arguments for every run, e.g. '--max-memory 2GB'")
    parser.add_argument("--gguf-layers", type=int, default=9, help="layers of the two Q8_0 GGUF inputs (18: ~1 GB)")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    models, _exact = make_inputs(work, parse_size(args.size))
    print("| run | device | wall s | CPU s | peak RSS MB | outputs |\n|---|---|---|---|---|---|", flush=True)
    # the cheap methods, then the GGUF outputs, then the SVD methods (the slowest on a CPU)
    methods: list[tuple[str, list[str]]] = [(m, []) for m in args.methods.split(",") if m]
    gguf_runs = [("linear", ["--out-type", "gguf", "--gguf-type", t]) for t in args.gguf.split(",") if t]
    runs = methods[:2] + gguf_runs + methods[2:]
    ggufs = []
    if args.gguf:
        from bench_gguf import make_input

        for seed in (1, 2):
            path = work / f"gguf-{args.gguf_layers}" / f"m{seed}.gguf"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                make_input(path, args.gguf_layers, seed)
            ggufs.append(path)
    for method, extra in runs:
        config = work / f"{method}.yml"
        config.write_text(config_text(method, [models[0], *ggufs] if extra else models))
        label = method + (f" → gguf {extra[-1]}" if extra else "")
        outs: dict[str, Path | None] = {}
        for device in ("cpu", "cuda"):
            out, state = work / f"out-{device}", work / f"state-{device}"
            for p in (out, state):
                shutil.rmtree(p, ignore_errors=True)
            try:
                argv = [sys.executable, "-m", "resumerge", "run", str(config), str(out), "--state-dir", str(state),
                        "--device", device, "-q", *extra, *shlex.split(args.resumerge_args)]
                m = run_measured(argv)
            except SystemExit as exc:
                print(f"| {label} | {device} | failed: {str(exc)[-600:]!r} | | | |", flush=True)
                outs[device] = None
                continue
            outs[device] = out
            verdict = ""
            cpu_out = outs.get("cpu")
            if device == "cuda" and cpu_out is not None:
                verdict = compare(cpu_out, out)
            row = f"| {label} | {device} | {m.wall:.2f} | {m.cpu:.1f} | {m.peak_rss / 1e6:.0f} | {verdict} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
