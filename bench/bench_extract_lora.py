"""``resumerge extract-lora`` next to ``mergekit-extract-lora`` 0.1.5: wall time, peak RSS and each module's error.

Usage::

    python bench/bench_extract_lora.py [--size 1.7GB] [--ranks 32,128] [--work DIR]
        [--tools resumerge,exact,mergekit] [--exact-ranks 32] [--model FT --base-model BASE]

Without ``--model``/``--base-model`` it generates a Llama-style float32 base of about ``--size`` bytes and a
fine-tune of it whose every matrix moved by a task vector like real fine-tunes': a decaying low-rank part plus
noise (kept in ``--work`` between invocations). For each rank it runs, each in a fresh process measured by the
launcher of ``bench_vs_mergekit.py`` (wall time, the process's own peak RSS), ``plan``'s estimate of it beside
it: resumerge's default (randomized truncation), resumerge ``--exact`` (the exact truncation, mergekit's numbers)
and mergekit-extract-lora (``--tools`` picks). Then, per LoRA module, the reconstruction error ‖ΔW − B·A‖_F of
each adapter against the exact rank-r truncation's, sqrt(Σ_{i>r} σ_i²) from the eigenvalues of ΔW's float64 Gram
matrix: the distribution of the ratio (min, median, 95th percentile, max; the goal is max ≤ 1.005). Prints
markdown rows for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_vs_mergekit import model_spec, run_measured  # noqa: E402

from resumerge.machine.memory.sizes import format_size, parse_size  # noqa: E402


def make_pair(work: Path, size: int) -> tuple[Path, Path]:
    """Generate BASE and FT (FT = BASE + decaying rank-64 part + noise on every matrix), once per size."""
    import torch
    from safetensors.torch import load_file, save_file

    from resumerge.cli.modelgen import make_model

    spec, exact = model_spec(size)
    base, ft = work / f"pair-{exact}" / "base", work / f"pair-{exact}" / "ft"
    if (ft / "config.json").exists():
        return base, ft
    print(f"generating {base.parent} ({format_size(exact)} each) ...", flush=True)
    shutil.rmtree(base.parent, ignore_errors=True)
    make_model(base, spec, seed=1)  # type: ignore[arg-type]
    shutil.copytree(base, ft)
    g = torch.Generator().manual_seed(2)
    spectrum = torch.tensor([0.95**i for i in range(64)])
    for path in sorted(ft.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.dim() == 2:
                m, n = t.shape
                low = (torch.randn(m, 64, generator=g) * spectrum) @ torch.randn(64, n, generator=g)
                low *= 0.01 * t.std() / low.std()
                tensors[name] = (t + low + 0.002 * t.std() * torch.randn(m, n, generator=g)).contiguous()
            else:
                tensors[name] = (t + 0.01 * torch.randn(t.shape, generator=g)).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return base, ft


def module_errors(base: Path, ft: Path, adapter: Path) -> dict[str, float]:
    """‖ΔW − B·A‖_F of every LoRA module of ``adapter`` (float64 arithmetic)."""
    from safetensors import safe_open

    read_base, read_ft = _reader(base), _reader(ft)
    errors = {}
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            if not key.endswith("lora_A.weight"):
                continue
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            a = f.get_tensor(key).double()
            b = f.get_tensor(key.replace("lora_A", "lora_B")).double()
            delta = read_ft(module + ".weight").double() - read_base(module + ".weight").double()
            errors[module] = float((delta - b @ a).norm())
    return errors


def exact_errors(base: Path, ft: Path, modules: list[str], ranks: list[int]) -> dict[int, dict[str, float]]:
    """The exact rank-r truncation's error of each module, ‖ΔW − best rank-r‖_F = sqrt(Σ_{i>r} σ_i²), for every
    rank: from the eigenvalues of ΔW's float64 Gram matrix (σ_i² exactly, to float64 rounding), with no SVD."""
    import torch

    read_base, read_ft = _reader(base), _reader(ft)
    found: dict[int, dict[str, float]] = {r: {} for r in ranks}
    for module in modules:
        delta = read_ft(module + ".weight").double() - read_base(module + ".weight").double()
        if delta.shape[0] > delta.shape[1]:
            delta = delta.T
        squares = torch.linalg.eigvalsh(delta @ delta.T).flip(0).clamp_min(0)  # σ_i², descending
        for r in ranks:
            found[r][module] = float(squares[r:].sum().sqrt())
    return found


def _reader(directory: Path):  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    from resumerge.config.modelref import ModelRef
    from resumerge.inputs.model import open_model

    model = open_model(ModelRef(str(directory)))
    return lambda name: safe_open(str(directory / model.tensors[name].file), "pt").get_tensor(name)


def plan_estimate(argv: list[str]) -> tuple[float | None, int]:
    """``plan``'s estimate of an extraction command line: (seconds, peak bytes)."""
    import json
    import subprocess

    done = subprocess.run([*argv, "--plan", "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(done.stdout)
    return doc["time"]["seconds"], doc["memory"]["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7GB")
    parser.add_argument("--ranks", default="32,128")
    parser.add_argument("--work", default="bench-work")
    parser.add_argument("--model")
    parser.add_argument("--base-model")
    parser.add_argument("--tools", default="resumerge,exact,mergekit",
                        help="which runs, comma-separated: resumerge, exact (resumerge --exact), mergekit")
    parser.add_argument("--exact-ranks", help="ranks of the --exact runs (default: --ranks)")
    args = parser.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    if args.model and args.base_model:
        base, ft = Path(args.base_model), Path(args.model)
    else:
        base, ft = make_pair(work, parse_size(args.size, option="--size"))
    wanted = args.tools.split(",")
    ranks = [int(r) for r in args.ranks.split(",")]
    exact_ranks = [int(r) for r in args.exact_ranks.split(",")] if args.exact_ranks else ranks
    rows = []
    outs: dict[tuple[int, str], Path] = {}
    for rank in ranks:
        tools = [("resumerge", [])] if "resumerge" in wanted else []
        if "exact" in wanted and rank in exact_ranks:
            tools.append(("resumerge --exact", ["--exact"]))
        if "mergekit" in wanted and shutil.which("mergekit-extract-lora"):
            tools.append(("mergekit", []))
        for tool, extra in tools:
            out = work / f"out-r{rank}-{tool.replace(' ', '').replace('-', '')}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(work / "state", ignore_errors=True)
            common = ["--model", str(ft), "--base-model", str(base), "--out-path", str(out), "--max-rank", str(rank)]
            estimate = ""
            if tool == "mergekit":
                argv = [str(shutil.which("mergekit-extract-lora")), *common]
            else:
                argv = [sys.executable, "-m", "resumerge", "extract-lora", *common, *extra, "-q",
                        "--state-dir", str(work / "state")]
                seconds, peak = plan_estimate(argv)
                estimate = f"{seconds:.1f} s, {format_size(peak)}" if seconds is not None else format_size(peak)
            print(f"rank {rank}: {tool} ...", flush=True)
            m = run_measured(argv)
            outs[(rank, tool)] = out
            rows.append(f"| {rank} | {tool} | {m.wall:.1f} s | {format_size(m.peak_rss)} | {estimate} |")
            print(rows[-1], flush=True)
    print("\n| rank | tool | wall | peak RSS | plan's estimate |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    errors = {key: module_errors(base, ft, out) for key, out in outs.items()}
    modules = sorted(next(iter(errors.values()))) if errors else []
    exact = exact_errors(base, ft, modules, ranks)
    print("\n| rank | tool | error/exact min | median | p95 | max | modules |")
    print("|---|---|---|---|---|---|---|")
    for (rank, tool), found in errors.items():
        ratios = sorted(found[k] / exact[rank][k] for k in found if exact[rank][k] > 0)
        p95 = ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))]
        print(f"| {rank} | {tool} | {ratios[0]:.5f} | {statistics.median(ratios):.5f} | {p95:.5f} | "
              f"{ratios[-1]:.5f} | {len(ratios)} |")
    print(f"\ncommand: {' '.join(sys.argv)}  (pair: {base} / {ft})")


if __name__ == "__main__":
    main()
