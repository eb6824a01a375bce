"""Sparse checkpoints with the real names, shapes, dtypes, shards and index of the largest open MoE models, and no
bytes: every shard is a valid safetensors header followed by a hole (``truncate``), so DeepSeek-V3's 689 GB cost a
few megabytes of disk and a second or two to write. Reading a payload gives zeros.

Layouts follow deepseek-ai/DeepSeek-V3 (``config.json``, ``README_WEIGHTS.md``, ``model.safetensors.index.json``:
61 layers, the first 3 dense, 256 routed experts and 1 shared, block-FP8 E4M3 weights each with an F32
``weight_scale_inv`` of [ceil(rows/128), ceil(cols/128)], BF16 norms, embeddings and routers, an F32
``e_score_correction_bias``, and the multi-token-prediction layer 61 with its own ``embed_tokens``, ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head``: 91,992 tensors in 163 shards) and MoonshotAI/Kimi-K2 (the same layout
with 1 dense layer, 384 experts, 64 heads, a 163,840-token vocabulary and no MTP layer, in 61 shards).

Used by the tests (``plan`` with an RSS bound) and by ``bench/bench_plan_scale.py``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

FP8_BLOCK = 128
_ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
Spec = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class Layout:
    """The dimensions of one DeepSeek-V3-style checkpoint, and how its files are named."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    dense_layers: int
    experts: int
    heads: int
    shards: int
    shard_name: str  # formatted with index= (1-based) and total=
    mtp_layers: int
    intermediate: int = 18432
    moe_intermediate: int = 2048
    shared_experts: int = 1
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    config_extra: dict[str, object] = field(default_factory=dict)


DEEPSEEK_V3 = Layout(
    model_type="deepseek_v3", vocab=129280, hidden=7168, layers=61, dense_layers=3, experts=256, heads=128,
    shards=163, shard_name="model-{index:05d}-of-{total:06d}.safetensors", mtp_layers=1,
    config_extra={"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "rope_theta": 10000,
                  "max_position_embeddings": 163840, "bos_token_id": 0, "eos_token_id": 1},
)
KIMI_K2 = Layout(
    model_type="kimi_k2", vocab=163840, hidden=7168, layers=61, dense_layers=1, experts=384, heads=64,
    shards=61, shard_name="model-{index}-of-{total}.safetensors", mtp_layers=0,
    config_extra={"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
                  "max_position_embeddings": 131072, "bos_token_id": 163584, "eos_token_id": 163585},
)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def _fp8(name: str, rows: int, cols: int) -> Iterator[Spec]:
    yield name, "F8_E4M3", (rows, cols)
    yield name + "_scale_inv", "F32", (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))


def _decoder_layer(lay: Layout, i: int) -> Iterator[Spec]:
    p, h = f"model.layers.{i}.", lay.hidden
    yield p + "input_layernorm.weight", "BF16", (h,)
    yield p + "post_attention_layernorm.weight", "BF16", (h,)
    a = p + "self_attn."
    yield from _fp8(a + "q_a_proj.weight", lay.q_lora_rank, h)
    yield a + "q_a_layernorm.weight", "BF16", (lay.q_lora_rank,)
    yield from _fp8(a + "q_b_proj.weight", lay.heads * (lay.qk_nope_head_dim + lay.qk_rope_head_dim), lay.q_lora_rank)
    yield from _fp8(a + "kv_a_proj_with_mqa.weight", lay.kv_lora_rank + lay.qk_rope_head_dim, h)
    yield a + "kv_a_layernorm.weight", "BF16", (lay.kv_lora_rank,)
    yield from _fp8(a + "kv_b_proj.weight", lay.heads * (lay.qk_nope_head_dim + lay.v_head_dim), lay.kv_lora_rank)
    yield from _fp8(a + "o_proj.weight", h, lay.heads * lay.v_head_dim)
    if i < lay.dense_layers:
        yield from _mlp(p + "mlp.", h, lay.intermediate)
        return
    yield p + "mlp.gate.weight", "BF16", (lay.experts, h)
    yield p + "mlp.gate.e_score_correction_bias", "F32", (lay.experts,)
    yield from _mlp(p + "mlp.shared_experts.", h, lay.moe_intermediate * lay.shared_experts)
    for j in range(lay.experts):
        yield from _mlp(f"{p}mlp.experts.{j}.", h, lay.moe_intermediate)


def _mlp(prefix: str, hidden: int, inner: int) -> Iterator[Spec]:
    yield from _fp8(prefix + "gate_proj.weight", inner, hidden)
    yield from _fp8(prefix + "up_proj.weight", inner, hidden)
    yield from _fp8(prefix + "down_proj.weight", hidden, inner)


def tensor_specs(lay: Layout, *, layers: int | None = None, mtp: bool = True) -> list[Spec]:
    """Every tensor of ``lay`` as (name, safetensors dtype, shape), in file order: the embedding, ``layers``
    decoder layers (all by default), the final norm and head, then (with ``mtp``) the MTP layers numbered from
    ``layers``, each a full MoE layer plus its own embedding, norms, ``eh_proj`` and head."""
    count = lay.layers if layers is None else layers
    h = lay.hidden
    specs: list[Spec] = [("model.embed_tokens.weight", "BF16", (lay.vocab, h))]
    for i in range(count):
        specs.extend(_decoder_layer(lay, i))
    specs += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (lay.vocab, h))]
    for i in range(count, count + (lay.mtp_layers if mtp else 0)):
        p = f"model.layers.{i}."
        specs.append((p + "embed_tokens.weight", "BF16", (lay.vocab, h)))
        specs += [(p + "enorm.weight", "BF16", (h,)), (p + "hnorm.weight", "BF16", (h,))]
        specs.extend(_fp8(p + "eh_proj.weight", h, 2 * h))
        specs.extend(_decoder_layer(lay, i))
        specs += [(p + "shared_head.norm.weight", "BF16", (h,)),
                  (p + "shared_head.head.weight", "BF16", (lay.vocab, h))]
    return specs


def nbytes(spec: Spec) -> int:
    """The payload bytes of one tensor."""
    return _ITEMSIZE[spec[1]] * math.prod(spec[2])


def model_config(lay: Layout, *, layers: int | None = None, mtp: bool = True) -> dict[str, object]:
    """``config.json`` as the model's repository has it (with its ``quantization_config``)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": lay.model_type, "attention_bias": False,
        "first_k_dense_replace": lay.dense_layers, "hidden_act": "silu", "hidden_size": lay.hidden,
        "intermediate_size": lay.intermediate, "kv_lora_rank": lay.kv_lora_rank, "moe_intermediate_size":
        lay.moe_intermediate, "moe_layer_freq": 1, "n_routed_experts": lay.experts, "n_shared_experts":
        lay.shared_experts, "norm_topk_prob": True, "num_attention_heads": lay.heads, "num_experts_per_tok": 8,
        "num_hidden_layers": lay.layers if layers is None else layers, "num_key_value_heads": lay.heads,
        "num_nextn_predict_layers": lay.mtp_layers if mtp else 0, "q_lora_rank": lay.q_lora_rank,
        "qk_nope_head_dim": lay.qk_nope_head_dim, "qk_rope_head_dim": lay.qk_rope_head_dim,
        "quantization_config": dict(QUANTIZATION_CONFIG), "rms_norm_eps": 1e-06, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
        "v_head_dim": lay.v_head_dim, "vocab_size": lay.vocab, **lay.config_extra,
    }


def _split(specs: list[Spec], shards: int) -> list[list[Spec]]:
    """Consecutive runs of ``specs`` of about equal bytes, ``shards`` of them (fewer for a model with fewer
    tensors), as the parents' files are laid out: in order, a new file when one has its share."""
    total = sum(map(nbytes, specs))
    groups: list[list[Spec]] = [[]]
    done = 0
    for spec in specs:
        if groups[-1] and done >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(spec)
        done += nbytes(spec)
    return groups


def write_shard(path: Path, specs: list[Spec], *, distinct: bool = False) -> int:
    """A safetensors file of ``specs`` whose payload is a hole; returns its size in bytes. ``distinct``: the same
    tensors at the same data offsets, but a header of other bytes (entries listed last first, its own metadata), as
    another writer saves another fine-tune of the same base."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **({"source": "distinct"} if distinct else {})}}
    offset = 0
    entries = []
    for name, dtype, shape in specs:
        size = nbytes((name, dtype, shape))
        entries.append((name, {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}))
        offset += size
    header.update(reversed(entries) if distinct else entries)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def write_sparse_checkpoint(directory: Path, lay: Layout = DEEPSEEK_V3, *, layers: int | None = None,
                            mtp: bool = True, shards: int | None = None, distinct: bool = False) -> Path:
    """Write ``lay`` (``layers`` decoder layers, the MTP layers with ``mtp``) into ``directory`` as sparse shards
    (``shards`` of them, the model's own count by default), ``model.safetensors.index.json`` and ``config.json``;
    returns ``directory``. ``distinct``: every shard's header in other bytes than the default's (see
    :func:`write_shard`): a second model whose tensors equal the first's but whose headers no parse can share."""
    directory.mkdir(parents=True, exist_ok=True)
    groups = _split(tensor_specs(lay, layers=layers, mtp=mtp), shards or lay.shards)
    weight_map: dict[str, str] = {}
    for index, group in enumerate(groups, 1):
        name = lay.shard_name.format(index=index, total=len(groups))
        write_shard(directory / name, group, distinct=distinct)
        weight_map.update(dict.fromkeys((spec[0] for spec in group), name))
    total = sum(nbytes(spec) for group in groups for spec in group)
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    config = model_config(lay, layers=layers, mtp=mtp)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def disk_usage(directory: Path) -> int:
    """Bytes the files in ``directory`` really occupy on disk (holes excluded)."""
    return sum(os.stat(p).st_blocks * 512 for p in directory.iterdir())
