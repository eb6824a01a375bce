"""``resumerge extract-lora`` next to ``mergekit-extract-lora`` 0.1.5: wall time, peak RSS and each module's error.

Usage::

    python bench/bench_extract_lora.py [--size 1.7GB] [--ranks 32,128] [--work DIR] [--skip-mergekit]
        [--model FT --base-model BASE]

Without ``--model``/``--base-model`` it generates a Llama-style float32 base of about ``--size`` bytes and a
fine-tune of it whose every matrix moved by a task vector like real fine-tunes': a decaying low-rank part plus
noise (kept in ``--work`` between invocations). For each rank it runs, each in a fresh process measured by the
launcher of ``bench_vs_mergekit.py`` (wall time, the process's own peak RSS): resumerge's default (randomized
truncation), resumerge ``--exact`` (full SVD, mergekit's numbers) and mergekit-extract-lora. Then, per LoRA
module, the reconstruction error ‖ΔW − B·A‖_F of each adapter against the exact rank-r truncation's (resumerge
``--exact``): the distribution of the ratio (min, median, 95th percentile, max; the goal is max ≤ 1.005). Prints
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

from bench_vs_mergekit import Measure, model_spec, run_measured  # noqa: E402

from resumerge.memory.sizes import format_size, parse_size  # noqa: E402


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

    from resumerge.config.modelref import ModelRef
    from resumerge.inputs.model import open_model

    def reader(directory: Path):  # type: ignore[no-untyped-def]
        model = open_model(ModelRef(str(directory)))
        return lambda name: safe_open(str(directory / model.tensors[name].file), "pt").get_tensor(name)

    read_base, read_ft = reader(base), reader(ft)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7GB")
    parser.add_argument("--ranks", default="32,128")
    parser.add_argument("--work", default="bench-work")
    parser.add_argument("--model")
    parser.add_argument("--base-model")
    parser.add_argument("--skip-mergekit", action="store_true")
    args = parser.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    if args.model and args.base_model:
        base, ft = Path(args.base_model), Path(args.model)
    else:
        base, ft = make_pair(work, parse_size(args.size, option="--size"))
    rows = []
    for rank in (int(r) for r in args.ranks.split(",")):
        runs: dict[str, tuple[Path, Measure]] = {}
        tools = [("resumerge", []), ("resumerge --exact", ["--exact"])]
        if not args.skip_mergekit and shutil.which("mergekit-extract-lora"):
            tools.append(("mergekit", []))
        for tool, extra in tools:
            out = work / f"out-r{rank}-{tool.replace(' ', '').replace('-', '')}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(work / "state", ignore_errors=True)
            common = ["--model", str(ft), "--base-model", str(base), "--out-path", str(out), "--max-rank", str(rank)]
            if tool == "mergekit":
                argv = [str(shutil.which("mergekit-extract-lora")), *common]
            else:
                argv = [sys.executable, "-m", "resumerge", "extract-lora", *common, *extra, "-q",
                        "--state-dir", str(work / "state")]
            print(f"rank {rank}: {tool} ...", flush=True)
            runs[tool] = (out, run_measured(argv))
        exact = module_errors(base, ft, runs["resumerge --exact"][0])
        for tool, (out, m) in runs.items():
            errors = module_errors(base, ft, out)
            ratios = sorted(errors[k] / exact[k] for k in exact if exact[k] > 0)
            p95 = ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))]
            rows.append(f"| {rank} | {tool} | {m.wall:.1f} s | {format_size(m.peak_rss)} | {ratios[0]:.5f} | "
                        f"{statistics.median(ratios):.5f} | {p95:.5f} | {ratios[-1]:.5f} | {len(ratios)} |")
            print(rows[-1], flush=True)
    print("\n| rank | tool | wall | peak RSS | error/exact min | median | p95 | max | modules |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\ncommand: {' '.join(sys.argv)}  (pair: {base} / {ft})")


if __name__ == "__main__":
    main()
