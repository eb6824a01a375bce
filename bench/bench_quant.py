"""Block-FP8 linear merge of two ~1 GB DeepSeek-style checkpoints against the disk floor (issue 43).

Usage: ``python bench/bench_quant.py [--runs N] [--work DIR] [--cases kept,dequantize,1GB]``

Generates the inputs once under ``--work`` (kept out of git: ``bench/work/`` is ignored): Llama-shaped, hidden
2048, intermediate 5632, 16 layers, vocab 8000 — every projection F8_E4M3 with F32 ``weight_scale_inv`` in
128x128 blocks (``quant_method: fp8``), embeddings, head and norms BF16, ~0.9 GB per model in 2 shards. The codes
are random bytes (no NaN) and the scales random: the merge's work does not depend on the values. Then, alternated
``--runs`` times, it times (wall, peak RSS of the command alone):

- ``kept``: a linear 0.5/0.5 merge written in the base's block-FP8 format (decode, merge, re-encode);
- ``dequantize``: the same with ``--dequantize`` (BF16 output, twice the bytes);
- ``1GB``: ``kept`` at ``--max-memory 1GB``.

(``--cases`` picks them and their order, e.g. ``--cases 1GB,kept``: each case's run follows the floor measured
after the case before it), and the disk floor of each output: a warm read of the inputs plus an fsynced write of
that output's size (``bench_linear.disk_floor``). Before the runs, ``resumerge plan --json`` estimates each case
with the same flags (start-up, compute timed on a sample, disk work, the last shard's flush). Prints one row per run
and the medians, with the run's CPU seconds (user + system, every process of it: on a shared machine the wall says
more about the others than about the run), the machine's load average, and the estimate against the median wall
and against the median CPU over the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
from pathlib import Path

from bench_linear import CONFIG as LINEAR
from bench_linear import disk_floor, run_measured
from plan_estimate import against_measured, compute_lines, plan_estimate, planned_text

HERE = Path(__file__).resolve().parent
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, BLOCK = 2048, 5632, 16, 8000, 128
# The same linear 0.5/0.5 merge, in float32 (the decoded values' dtype: no cast before or after the merge); what is
# stored plainly (embeddings, norms, everything with --dequantize) is written in bfloat16.
CONFIG = LINEAR + "out_dtype: bfloat16\n"


def make_model(path: Path, seed: int) -> None:
    """One block-FP8 checkpoint at ``path`` (skipped when present)."""
    import torch
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    print(f"generating {path} ...", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
        grid = (-(-rows // BLOCK), -(-cols // BLOCK))
        return codes.view(torch.float8_e4m3fn), torch.rand(grid, generator=g) * 1e-3 + 1e-5

    def bf16(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": bf16(VOCAB, HIDDEN)}, {}]
    for i in range(LAYERS):
        shard = shards[0] if i < LAYERS // 2 else shards[1]
        p = f"model.layers.{i}."
        for name, rows, cols in (("self_attn.q_proj", HIDDEN, HIDDEN), ("self_attn.k_proj", HIDDEN, HIDDEN),
                                 ("self_attn.v_proj", HIDDEN, HIDDEN), ("self_attn.o_proj", HIDDEN, HIDDEN),
                                 ("mlp.gate_proj", INTERMEDIATE, HIDDEN), ("mlp.up_proj", INTERMEDIATE, HIDDEN),
                                 ("mlp.down_proj", HIDDEN, INTERMEDIATE)):
            shard[f"{p}{name}.weight"], shard[f"{p}{name}.weight_scale_inv"] = fp8(rows, cols)
        shard[f"{p}input_layernorm.weight"] = bf16(HIDDEN)
        shard[f"{p}post_attention_layernorm.weight"] = bf16(HIDDEN)
    shards[1]["model.norm.weight"] = bf16(HIDDEN)
    shards[1]["lm_head.weight"] = bf16(VOCAB, HIDDEN)
    weight_map = {}
    for n, tensors in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [BLOCK, BLOCK]}}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=HERE / "work" / "quant")
    parser.add_argument("--cases", default="kept,dequantize,1GB",
                        help="which cases, in the order each run takes them (the first follows the previous run's "
                             "last floor: name another first to see whether the order moves a figure)")
    args = parser.parse_args()
    a, b = args.work / "a", args.work / "b"
    make_model(a, 1)
    make_model(b, 2)
    config = args.work / "linear.yml"
    config.write_text(CONFIG.format(a=a, b=b))
    flags_of = {"kept": [], "dequantize": ["--dequantize"], "1GB": ["--max-memory", "1GB"]}
    cases = {case: flags_of[case] for case in args.cases.split(",")}
    rows: dict[str, list[tuple[float, int, float, float]]] = {case: [] for case in cases}
    planned = {}
    for case, flags in cases.items():
        load = os.getloadavg()[0]
        planned[case] = plan_estimate(config, args.work / "out-plan", args.work / "state-plan", flags)
        print(f"{case:10s} plan estimate {planned_text(planned[case])}  load {load:.1f}", flush=True)
        for line in compute_lines(planned[case]):
            print(f"           {line}", flush=True)
    for run in range(args.runs):
        for case, flags in cases.items():
            out, state = args.work / f"out-{case}", args.work / "state"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)
            load = os.getloadavg()[0]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall, rss, code = run_measured([sys.executable, "-m", "resumerge", "run", str(config), str(out),
                                            "--quiet", "--state-dir", str(state), *flags])
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run's CPU: what a busy machine cannot hide
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            if code != 0:
                raise SystemExit(f"{case} failed with exit code {code}")
            size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
            read, write = disk_floor([a, b], size, args.work)
            floor = read + write
            rows[case].append((wall, rss, floor, cpu))
            print(f"run {run + 1} {case:10s} wall {wall:6.2f} s  CPU {cpu:6.2f} s  floor {floor:5.2f} s (read "
                  f"{read:.2f}, write {size / 1e9:.2f} GB {write:.2f})  {wall / floor:4.2f}x  peak RSS "
                  f"{rss / 1e6:6.0f} MB  load {load:.1f}", flush=True)
    print("\n| case | median wall s | median CPU s | median floor s | x floor | median peak RSS MB |\n"
          "|---|---|---|---|---|---|")
    notes = []
    for case, found in rows.items():
        wall, cpu = statistics.median(r[0] for r in found), statistics.median(r[3] for r in found)
        floor = statistics.median(r[2] for r in found)
        print(f"| {case} | {wall:.2f} | {cpu:.2f} | {floor:.2f} | {wall / floor:.2f}x | "
              f"{statistics.median(r[1] for r in found) / 1e6:.0f} |")
        notes.append(f"- {case}: `resumerge plan` estimated {planned_text(planned[case])}: "
                     f"{against_measured(planned[case], wall, cpu, os.cpu_count() or 1)}")
    print("\n" + "\n".join(notes))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
