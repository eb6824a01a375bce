"""Tiny GGUF files for the tests, written with gguf-py's own writer in llama.cpp's layout (names, per-family
transforms, hyperparameter keys: ``shared/reference/gguf.md`` §3-4), and an independent reference decoding: gguf-py's
reader and dequantizer with the inverse transforms as transformers' GGUF loader applies them."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from realmodel import cached, publish, smollm2_gguf

from resumerge.config.modelref import ModelRef
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.model import ModelInput, open_model
from resumerge.inputs.source import InputSources
from resumerge.merge.plan.inputrefs import read_value, tensor_ref

Q = gguf.GGMLQuantizationType
HIDDEN, FF, HEADS, KV, HEAD_DIM, VOCAB, LAYERS, EXPERTS = 256, 512, 4, 2, 64, 40, 2, 3
# A byte-level BPE vocabulary transformers rebuilds (lower-case letters, digits, space, "th", ".", BOS last): texts
# of those characters tokenize.
TOKENS = (*"abcdefghijklmnopqrstuvwxyz0123456789", "\u0120", "th", ".", "<s>")
assert len(TOKENS) == VOCAB
# Tensor types the writer stores plainly; the others as random blocks (gguf-py quantizes only some of them).
PLAIN = {Q.F32: np.float32, Q.F16: np.float16}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's HF -> GGUF q/k row order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' GGUF loader's inverse of :func:`permute`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_tensors(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of a tiny ``arch`` model, by HF name."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        value = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:  # bf16 values of at least 2^-16, as trained norms are: w + 1 - 1 == w in float32
            value = torch.from_numpy(np.where(np.abs(value) < 2**-16, 0.5, value)).bfloat16().float().numpy()
        return value

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN)}
    if arch != "gemma2":
        out["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": w(HIDDEN), p + "post_attention_layernorm.weight": w(HIDDEN),
                    p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV * HEAD_DIM, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV * HEAD_DIM, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM)})
        if arch == "qwen2":
            out.update({p + f"self_attn.{x}_proj.bias": w(n * HEAD_DIM) for x, n in (("q", HEADS), ("k", KV),
                                                                                       ("v", KV))})
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            out.update({p + "self_attn.q_norm.weight": w(HEAD_DIM), p + "self_attn.k_norm.weight": w(HEAD_DIM)})
        if arch in ("gemma2", "gemma3"):
            out.update({p + "pre_feedforward_layernorm.weight": w(HIDDEN),
                        p + "post_feedforward_layernorm.weight": w(HIDDEN)})
        if arch == "qwen3moe":
            out[p + "mlp.gate.weight"] = w(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                out.update({p + f"mlp.experts.{e}.gate_proj.weight": w(FF, HIDDEN),
                            p + f"mlp.experts.{e}.up_proj.weight": w(FF, HIDDEN),
                            p + f"mlp.experts.{e}.down_proj.weight": w(HIDDEN, FF)})
        else:
            out.update({p + "mlp.gate_proj.weight": w(FF, HIDDEN), p + "mlp.up_proj.weight": w(FF, HIDDEN),
                        p + "mlp.down_proj.weight": w(HIDDEN, FF)})
    return out


def _gguf_name(arch: str, hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    gemma = arch in ("gemma2", "gemma3")
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    base, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{names[base]}.{suffix}"


def to_gguf(arch: str, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``hf`` as llama.cpp's converter stores it: renamed, llama's q/k permuted, gemma's norms +1, experts stacked."""
    out: dict[str, np.ndarray] = {}
    for name, value in hf.items():
        if ".experts." in name:
            continue
        if arch == "llama" and "q_proj" in name:
            value = permute(value, HEADS)
        elif arch == "llama" and "k_proj" in name:
            value = permute(value, KV)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1
        out[_gguf_name(arch, name)] = value
    for i in range(LAYERS if arch == "qwen3moe" else 0):
        for proj in ("gate", "up", "down"):
            out[f"blk.{i}.ffn_{proj}_exps.weight"] = np.stack(
                [hf[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)])
    return out


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], qtype: Q, *, seed: int = 0,
               split_max_tensors: int = 0, name: str = "", merges: tuple[str, ...] = ("t h",),
               chat_template: str = "{% for m in messages %}{{ m.content }}{% endfor %}") -> None:
    """A GGUF of ``arch`` holding ``tensors`` (GGUF names, float32): matrices as ``qtype`` (F32/F16/BF16/Q8_0/Q4_0/
    Q4_1 quantized by gguf-py; other types as random blocks), 1-D tensors F32 as llama.cpp stores them; ``merges``:
    the tokenizer's BPE merges (one of tokens outside the vocabulary: a tokenizer transformers cannot rebuild);
    ``chat_template``: the tokenizer's."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    if name:
        writer.add_basename(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    # A tokenizer as llama.cpp's converter writes one (a GGUF output copies these keys with their types), which
    # transformers rebuilds (a check's prompts, a MoE output's tokenizer).
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(TOKENS))
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(VOCAB - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(FF)
    for name, value in tensors.items():
        if value.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(name, value)
        elif qtype in PLAIN:
            writer.add_tensor(name, value.astype(PLAIN[qtype]))
        elif qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = (*value.shape[:-1], value.shape[-1] // block * size)
            blocks = rng.integers(0, 256, shape, dtype=np.uint8)
            # No byte with a float16's exponent bits all set: every scale the blocks hold is finite.
            blocks[(blocks & 0x7C) == 0x7C] &= 0xFB
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF at ``path`` as gguf-py dequantizes it, under its HF name with transformers' inverse
    transforms (q/k un-permuted for llama, norms -1 for gemma, experts unstacked)."""
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = int(reader.fields[f"{arch}.attention.head_count"].parts[-1][0])
    kv = int(reader.fields[f"{arch}.attention.head_count_kv"].parts[-1][0])
    names = {_gguf_name(arch, hf): hf for hf in hf_tensors(arch) if ".experts." not in hf}
    out = {}
    for t in reader.tensors:
        value = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if "_exps." in t.name:
            layer, proj = t.name.split(".")[1], t.name.split(".")[2].split("_")[1]
            out.update({f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight": value[e]
                        for e in range(value.shape[0])})
            continue
        if arch == "llama" and ".attn_q." in t.name:
            value = unpermute(value, heads)
        elif arch == "llama" and ".attn_k." in t.name:
            value = unpermute(value, kv)
        elif arch in ("gemma2", "gemma3") and "norm.weight" in t.name:
            value = value - 1
        out[names[t.name]] = value
    return out


def decoded(path: Path) -> tuple[ModelInput, dict[str, torch.Tensor]]:
    """The GGUF at ``path`` opened and every tensor decoded by resumerge, by HF name; each also decoded as the
    engine decodes it, its bytes read into a reused buffer and its value into another (in place there: llama's q/k
    re-ordered, gemma's norms -1), bit for bit the same."""
    model = open_model(ModelRef(str(path))).recognised(CODECS)
    values = {}
    with InputSources.local({"m": str(model.directory)}) as sources:
        for name in model.tensors:
            ref = tensor_ref("m", model, name)
            values[name] = value = read_value(ref, sources).clone()
            into = torch.full(value.shape, 7.0, dtype=value.dtype)
            raw = torch.full((ref.end - ref.start + 64,), 0xAB, dtype=torch.uint8)
            assert read_value(ref, sources, into, raw) is into, name
            assert torch.equal(into.view(torch.int32), value.view(torch.int32)), name
    return model, values


def metadata_of(path: Path) -> dict[str, Any]:
    """The GGUF's key-value metadata, as gguf-py reads it (the reader's own fields)."""
    return {name: field for name, field in gguf.GGUFReader(path).fields.items()}


@contextmanager
def name_maps_built_once() -> Iterator[None]:
    """transformers' GGUF loader, for each module of the model it loads, builds gguf-py's ``TensorNameMap`` of the
    architecture and block count again (a pure function of the two: ~7 ms each, ~400 modules, 3-5 s per load of
    SmolLM2's 30 layers); within the block each is built once and handed back, and the loader does what it does
    otherwise."""
    cached = functools.cache(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", cached)  # transformers imports it from gguf at each call
        yield


@contextmanager
def readers_built_once() -> Iterator[None]:
    """gguf-py's ``GGUFReader`` of each file built once within the block and handed back to every caller after the
    first: transformers' GGUF loader parses a whole file again for a tokenizer's config, a model's config and its
    weights, and a parse turns every element of the vocabulary and the merges into a memmap slice (SmolLM2's 49,152
    tokens and 48,900 merges: seconds each). The reader only reads a file no one writes within the block (its size
    and mtime are its key too); the loader does what it does otherwise."""
    built: dict[tuple[str, int, int, str], gguf.GGUFReader] = {}
    reader_of = gguf.GGUFReader

    def reader(path: Any, mode: str = "r") -> gguf.GGUFReader:
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in built:
            built[key] = reader_of(path, mode)  # type: ignore[arg-type]
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)  # transformers imports it from gguf at each call, as the tests do
        yield


def made_once(name: str, make: Callable[[Path], object], *helpers: Callable[..., object]) -> Path:
    """A folder ``make`` fills, made once per machine beside realmodel's caches: what gguf-py makes of the real GGUF
    (no resumerge code takes part; read only by the tests). Keyed by all that decides its bytes: the ``helpers``'
    code (every function of the tests' own that ``make`` calls), gguf-py's and numpy's versions, and the real file's
    identity. Not by this file's text: an edit to any helper here (none of which ``make`` calls) named new folders
    and made a run rebuild them (a full run's two real-model tests paid ~15 CPU s of gguf-py dequantizing so)."""
    from importlib.metadata import version

    source = smollm2_gguf().stat()
    digest = hashlib.sha256()
    for part in (*(inspect.getsource(helper) for helper in helpers),
                 version("gguf"), version("numpy"),
                 f"{source.st_size}:{source.st_mtime_ns}"):
        digest.update(hashlib.sha256(part.encode()).digest())
    target = cached(f"smollm2-{name}-{digest.hexdigest()[:16]}")
    if not (target / "made").is_file():
        building = target.with_name(f"{target.name}.{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
        make(building)
        (building / "made").write_text("")
        publish(building, target)
    return target


def linear_llama_config(root: Path, dtype: str = "float32") -> Path:
    """A linear merge (0.3/0.7, in ``dtype``) of two tiny llama GGUFs (seeds 1 and 2, F32) under ``root``: its
    config (``c.yml``). The GGUFs are written once: a second call over the same root reuses them."""
    from support import write_config

    a, b = root / "a.gguf", root / "b.gguf"
    if not a.exists():
        write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
        write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.F32)
    return write_config(root / "c.yml", {"merge_method": "linear", "dtype": dtype, "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})


def linear_llama_pair(root: Path, texts: str) -> tuple[Path, Path]:
    """A float16 :func:`linear_llama_config` under ``root``, and a texts file of ``texts`` (what the importance
    matrix's tests calibrate on)."""
    config = linear_llama_config(root, "float16")
    path = root / "texts.txt"
    path.write_text(texts)
    return config, path
