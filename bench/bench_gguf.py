"""GGUF -> GGUF linear merge of two ~1 GB Q8_0 models against the disk floor and the manual route (issue 58).

Usage: ``python bench/bench_gguf.py [--runs N] [--work DIR] [--layers N] [--skip-manual]``

Generates the inputs once under ``--work`` (``bench/work/`` is ignored by git) with gguf-py: two llama GGUFs
(hidden 2048, intermediate 5632, 18 layers, 32 heads / 8 KV heads, vocabulary 32000, untied head), every matrix
Q8_0 of random normal values, norms F32, ~1.05 GB each, streamed tensor by tensor. Then it times (wall, CPU = user
+ system of every process of the command, peak RSS of the largest one):

- ``resumerge``: ``resumerge run`` of a linear 0.5/0.5 merge, ``--out-type gguf --gguf-type q8_0`` (fully durable);
- ``floor``: a warm read of both inputs plus an fsynced write of the output's size (what any tool must do);
- ``manual``: what a user does today, as three commands: dequantize each GGUF to float16 safetensors with gguf-py
  (names mapped with gguf-py's ``TensorNameMap``, q/k un-permuted), ``mergekit-yaml`` linear, and a gguf-py script
  that re-quantizes the merge to Q8_0 (q/k permuted back, the first parent's key-values copied).

On a shared machine wall time says as much about the other jobs as about the run: the CPU seconds and the load
average are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_linear import read_floor, write_floor  # the disk floor as bench_linear measures it

HERE = Path(__file__).resolve().parent
HIDDEN, FF, HEADS, KV, VOCAB = 2048, 5632, 32, 8, 32000
HEAD_DIM = HIDDEN // HEADS
_LAUNCHER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(code, u.ru_maxrss, u.ru_utime + u.ru_stime)
"""


def measured(argv: list[str]) -> tuple[float, float, int]:
    """Run ``argv``: (wall s, CPU s of it and its children, peak RSS MB of the largest of them)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    code, peak, cpu = done.stdout.split()[-3:]
    if int(code) != 0:
        sys.exit(f"{argv[:4]} failed:\n{done.stderr[-3000:]}")
    return wall, float(cpu), int(peak) // 1024


def _hf_names(layers: int) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")]
    return names


def _shape(name: str) -> tuple[int, ...]:
    if name.endswith("norm.weight"):
        return (HIDDEN,)
    if "embed_tokens" in name or "lm_head" in name:
        return (VOCAB, HIDDEN)
    if "k_proj" in name or "v_proj" in name:
        return (KV * HEAD_DIM, HIDDEN)
    if "gate_proj" in name or "up_proj" in name:
        return (FF, HIDDEN)
    if "down_proj" in name:
        return (HIDDEN, FF)
    return (HIDDEN, HIDDEN)


def _name_map(layers: int) -> dict[str, str]:
    """HF name -> GGUF name, by gguf-py's own table."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    return {n: table.get_name(n, try_suffixes=(".weight",)) for n in _hf_names(layers)}  # type: ignore[misc]


def _permute(w: np.ndarray, heads: int, back: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved per head), or back from it."""
    rows = w.shape[0]
    if back:
        return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_input(path: Path, layers: int, seed: int) -> None:
    """A llama Q8_0 GGUF of random weights, written one tensor at a time."""
    import gguf

    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(7)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["t 1"])
    names = _name_map(layers)
    for hf, name in names.items():
        shape = _shape(hf)
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            writer.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, q8), np.dtype(np.uint8),
                                   shape[0] * shape[1] // 32 * 34, raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf in names:
        shape = _shape(hf)
        value = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if len(shape) == 1:
            value += 1
        writer.write_tensor_data(value if len(shape) == 1 else gguf.quants.quantize(value, q8))
    writer.close()


def dequantize_to_safetensors(gguf_path: Path, out: Path, layers: int) -> None:
    """Manual route, step 1: the GGUF as a float16 safetensors folder (gguf-py's dequantizer)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    by_gguf = {g: hf for hf, g in _name_map(layers).items()}
    state = {}
    for tensor in reader.tensors:
        hf = by_gguf[tensor.name]
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(_shape(hf))
        if "q_proj" in hf or "k_proj" in hf:
            value = _permute(value, HEADS if "q_proj" in hf else KV, back=True)
        state[hf] = torch.from_numpy(np.ascontiguousarray(value)).to(torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FF, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float16"}))


def write_gguf_from_safetensors(folder: Path, template: Path, out: Path, layers: int) -> None:
    """Manual route, step 3: the merged safetensors re-quantized to a Q8_0 GGUF with gguf-py."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(template)
    writer = gguf.GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        types = field.types
        writer.add_key_value(field.name, field.contents(), types[0], sub_type=types[-1] if len(types) > 1 else None)
    q8 = gguf.GGMLQuantizationType.Q8_0
    names = _name_map(layers)
    files = sorted(folder.glob("*.safetensors"))
    handles = [safe_open(str(f), "np") for f in files]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    for hf, name in names.items():
        value = where[hf].get_tensor(hf).astype(np.float32)
        if "q_proj" in hf or "k_proj" in hf:
            value = _permute(value, HEADS if "q_proj" in hf else KV)
        writer.add_tensor(name, value if value.ndim == 1 else gguf.quants.quantize(value, q8),
                          raw_dtype=None if value.ndim == 1 else q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def floor(inputs: list[Path], out_bytes: int, work: Path) -> float:
    """Warm read of the inputs plus an fsynced write of ``out_bytes``, seconds."""
    return read_floor(inputs) + write_floor(out_bytes, work)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=HERE / "work" / "gguf")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--skip-manual", action="store_true")
    parser.add_argument("--step", nargs="+", help=argparse.SUPPRESS)  # the manual route's own commands
    args = parser.parse_args()
    if args.step:
        kind, *paths = args.step
        if kind == "dequantize":
            dequantize_to_safetensors(Path(paths[0]), Path(paths[1]), args.layers)
        else:
            write_gguf_from_safetensors(Path(paths[0]), Path(paths[1]), Path(paths[2]), args.layers)
        return
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    inputs = [work / "a.gguf", work / "b.gguf"]
    for seed, path in enumerate(inputs, 1):
        if not path.exists():
            print(f"generating {path} ...", flush=True)
            make_input(path.with_suffix(".part"), args.layers, seed)
            path.with_suffix(".part").rename(path)
    size = sum(p.stat().st_size for p in inputs) // 2
    print(f"inputs: 2 x {size / 1e9:.2f} GB Q8_0; load average {os.getloadavg()}", flush=True)
    config = work / "linear.yml"
    config.write_text("merge_method: linear\ndtype: float32\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in inputs))
    rows: dict[str, list[tuple[float, float, int]]] = {}
    for _ in range(args.runs):
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "state", ignore_errors=True)
        rows.setdefault("resumerge", []).append(measured(
            [sys.executable, "-m", "resumerge", "run", str(config), str(out), "--state-dir", str(work / "state"),
             "--out-type", "gguf", "--gguf-type", "q8_0"]))
        out_bytes = (out / "model.gguf").stat().st_size
        rows.setdefault("floor", []).append((floor(inputs, out_bytes, work), 0.0, 0))
        if args.skip_manual:
            continue
        steps = []
        for path in inputs:
            folder = work / f"st-{path.stem}"
            shutil.rmtree(folder, ignore_errors=True)
            steps.append(measured([sys.executable, __file__, "--layers", str(args.layers), "--step", "dequantize",
                                   str(path), str(folder)]))
        manual = work / "manual.yml"
        manual.write_text("merge_method: linear\ndtype: float16\nmodels:\n" + "".join(
            f"  - model: {work / f'st-{p.stem}'}\n    parameters: {{weight: 0.5}}\n" for p in inputs))
        shutil.rmtree(work / "mk", ignore_errors=True)
        steps.append(measured([shutil.which("mergekit-yaml") or "mergekit-yaml", str(manual), str(work / "mk"),
                               "--out-shard-size", "5B"]))
        steps.append(measured([sys.executable, __file__, "--layers", str(args.layers), "--step", "write",
                               str(work / "mk"), str(inputs[0]), str(work / "manual.gguf")]))
        print("manual steps (wall s, CPU s, peak MB): " + "; ".join(f"{w:.1f}, {c:.1f}, {m}" for w, c, m in steps))
        rows.setdefault("manual", []).append((sum(s[0] for s in steps), sum(s[1] for s in steps),
                                              max(s[2] for s in steps)))
    base = statistics.median(r[0] for r in rows["floor"])
    print(f"\nload average after: {os.getloadavg()}")
    print("| run | median wall s (each) | CPU s | peak RSS MB | wall vs floor |\n|---|---|---|---|---|")
    for name, got in rows.items():
        wall = statistics.median(r[0] for r in got)
        print(f"| {name} | {wall:.1f} ({', '.join(f'{r[0]:.1f}' for r in got)}) | "
              f"{statistics.median(r[1] for r in got):.1f} | {max(r[2] for r in got)} | {wall / base:.2f}x |")


if __name__ == "__main__":
    main()
