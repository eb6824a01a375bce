"""MoE upcycling with hidden-state gates: ``resumerge run`` next to ``mergekit-moe`` on generated Llamas.

Usage::

    python bench/bench_moe.py [--size 1.7GB] [--experts 2] [--max-memory 1GB] [--work DIR] [--skip-mergekit]

Generates float32 Llama-style models of about ``--size`` bytes (the base and the experts; kept in ``--work``,
shared with bench_vs_mergekit.py), writes a ``gate_mode: hidden`` config over them, and runs it through
``resumerge run --max-memory SIZE`` and ``mergekit-moe`` (its default device, cpu), reporting each one's wall time,
peak RSS (of the merge process alone) and output bytes, and whether every output tensor has the same bits.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_vs_mergekit import make_inputs, run_measured  # noqa: E402

from resumerge.memory.sizes import format_size, parse_size  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7GB")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--max-memory", default="1GB")
    parser.add_argument("--work", default=str(ROOT / "bench" / "work"))
    parser.add_argument("--skip-mergekit", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    models, exact = make_inputs(work, parse_size(args.size, option="--size"))
    config = work / f"moe-{exact}-{args.experts}.yml"
    config.write_text(_config(models, args.experts))
    outs = {"resumerge": work / "moe-out-resumerge", "mergekit-moe": work / "moe-out-mergekit"}
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / "moe-state", ignore_errors=True)
    runs = {"resumerge": [sys.executable, "-m", "resumerge", "run", str(config), str(outs["resumerge"]),
                          "--state-dir", str(work / "moe-state"), "--max-memory", args.max_memory, "--quiet"]}
    if not args.skip_mergekit:
        runs["mergekit-moe"] = [shutil.which("mergekit-moe") or "mergekit-moe", str(config),
                                str(outs["mergekit-moe"])]
    print(f"models {format_size(exact)} each, {args.experts} experts, gate_mode hidden, bfloat16 output")
    for tool, argv in runs.items():
        m = run_measured(argv)
        size = sum(p.stat().st_size for p in outs[tool].glob("*.safetensors"))
        print(f"| {tool} | {m.wall:.1f} s | {format_size(m.peak_rss)} | {format_size(size)} |", flush=True)
    if not args.skip_mergekit:
        print("same tensors, same bits:", _same_bits(outs["resumerge"], outs["mergekit-moe"]))


if __name__ == "__main__":
    main()
