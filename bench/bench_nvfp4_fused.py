"""What sharing one NVFP4 tensor-wide scale per fused group (q/k/v, gate/up) costs a merge written as NVFP4.

Usage: ``python bench/bench_nvfp4_fused.py [--runs N] [--work DIR]``

Generates two Llama-shaped compressed-tensors ``nvfp4-pack-quantized`` checkpoints once under ``--work`` (hidden 1024,
intermediate 2816, 8 layers, vocab 8000; every projection NVFP4 with random codes and block scales, embeddings, head
and norms BF16). Then, alternated ``--runs`` times in this process, a linear 0.5/0.5 merge kept in NVFP4 with the
groups the planner makes (``grouped``: each group measured before its members are encoded) and with the planner's
grouping switched off (``alone``: each projection its own scale, as before the groups). Prints the wall and CPU
seconds (user + system of this process, its threads included) of each run, their medians and the ratio of the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, HEADS, KV_HEADS = 1024, 2816, 8, 8000, 16, 4
CONFIG = "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n" \
         "  - model: {b}\n    parameters: {{weight: 0.5}}\n"


def make_model(path: Path, seed: int) -> None:
    """One compressed-tensors NVFP4 checkpoint at ``path`` (skipped when present)."""
    import torch
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def nvfp4(name: str, rows: int, cols: int) -> None:
        tensors[f"{name}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        scale = torch.rand((rows, cols // 16), generator=g) * 400 + 1
        tensors[f"{name}.weight_scale"] = scale.to(torch.float8_e4m3fn)
        tensors[f"{name}.weight_global_scale"] = torch.tensor([2688.0 / 0.05])

    def bf16(name: str, *shape: int) -> None:
        tensors[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    head = HIDDEN // HEADS
    bf16("model.embed_tokens.weight", VOCAB, HIDDEN)
    bf16("lm_head.weight", VOCAB, HIDDEN)
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        at = f"model.layers.{layer}"
        for proj, rows, cols in (("q_proj", HIDDEN, HIDDEN), ("k_proj", KV_HEADS * head, HIDDEN),
                                 ("v_proj", KV_HEADS * head, HIDDEN), ("o_proj", HIDDEN, HIDDEN)):
            nvfp4(f"{at}.self_attn.{proj}", rows, cols)
        for proj, rows, cols in (("gate_proj", INTERMEDIATE, HIDDEN), ("up_proj", INTERMEDIATE, HIDDEN),
                                 ("down_proj", HIDDEN, INTERMEDIATE)):
            nvfp4(f"{at}.mlp.{proj}", rows, cols)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{at}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "dynamic": False}
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                "quantization_status": "compressed",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                                              "input_activations": None}},
                                "ignore": ["lm_head"]}}))


def run_once(config: Path, out: Path, state: Path, *, grouped: bool) -> tuple[float, float]:
    """(wall, CPU seconds) of one merge of ``config`` into ``out``, the planner's groups switched off unless
    ``grouped``."""
    from resumerge import api
    from resumerge.merge.plan import planner

    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    kept = planner.share_scales
    if not grouped:
        planner.share_scales = dict  # type: ignore[assignment]
    try:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        api.run(config, out, settings=api.Settings(state_dir=state))
        wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        planner.share_scales = kept
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=HERE / "work" / "nvfp4_fused")
    args = parser.parse_args()
    work: Path = args.work
    make_model(work / "a", 1)
    make_model(work / "b", 2)
    config = work / "merge.yml"
    config.write_text(CONFIG.format(a=work / "a", b=work / "b"))
    found: dict[str, list[tuple[float, float]]] = {"alone": [], "grouped": []}
    for run in range(args.runs):
        for case in ("alone", "grouped"):
            wall, cpu = run_once(config, work / f"out-{case}", work / f"state-{case}", grouped=case == "grouped")
            found[case].append((wall, cpu))
            print(f"run {run + 1} {case:8} wall {wall:6.2f} s  cpu {cpu:6.2f} s  load {os.getloadavg()[0]:.1f}",
                  flush=True)
    medians = {case: (statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows))
               for case, rows in found.items()}
    for case, (wall, cpu) in medians.items():
        print(f"median {case:8} wall {wall:6.2f} s  cpu {cpu:6.2f} s")
    print(f"grouped / alone: wall {medians['grouped'][0] / medians['alone'][0]:.2f}x, "
          f"cpu {medians['grouped'][1] / medians['alone'][1]:.2f}x")


if __name__ == "__main__":
    main()
