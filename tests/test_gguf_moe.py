"""GGUF outputs of mixtures of experts: each layer's routed experts stacked per projection as llama.cpp's converter
stacks them (``blk.N.ffn_{gate,up,down}_exps.weight`` [E, rows, cols], expert e at ``[e]``), routers F32, the
``{arch}.expert_*`` keys; every tensor byte-equal to gguf-py's quantizer applied to the merged float32 values (the
same merge written as safetensors), mapped and stacked by the test's own table. transformers' GGUF loader reads the
written qwen3moe and qwen2moe files as the same model (logits within float32 summation order), given the config:
its GGUF config table has no key for the expert width (``expert_feed_forward_length``), so alone it builds experts
of its default width 768 and refuses the tiny ones."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ggufmodels import HEADS, KV, Q, decoded, hf_tensors, permute, readers_built_once, to_gguf, write_gguf
from safetensors.torch import load_file, save_file
from support import write_config

from resumerge import api

TYPES = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "block_sparse_moe.gate": "ffn_gate_inp"}
_MIXTRAL = {"w1": "gate", "w3": "up", "w2": "down"}


def _expected(arch: str, merged: dict[str, torch.Tensor], heads: int = HEADS, kv: int = KV) -> dict[str, np.ndarray]:
    """The merged HF tensors as llama.cpp's converter stores them: renamed, per-expert tensors stacked, fused
    gate_up stacks cut into gate and up, llama's q/k rows permuted."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in merged.items():
        value = tensor.float().numpy()
        if name in _TOP:
            out[_TOP[name]] = value
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()  # type: ignore[union-attr]
        expert = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                              r"\.weight", rest)
        if expert is not None:
            projection = _MIXTRAL.get(expert.group(2), expert.group(2).removesuffix("_proj"))
            stacks.setdefault(f"blk.{layer}.ffn_{projection}_exps.weight", {})[int(expert.group(1))] = value
        elif rest == "mlp.experts.gate_up_proj":
            half = value.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = (value[:, :half],
                                                                                                value[:, half:])
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = value
        else:
            base, _, suffix = rest.rpartition(".")
            if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                value = permute(value, heads if base == "self_attn.q_proj" else kv)
            out[f"blk.{layer}.{_BLOCK[base]}.{suffix}"] = value
    for target, experts in stacks.items():
        out[target] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _check_tensors(path: Path, expected: dict[str, np.ndarray], gguf_type: str) -> gguf.GGUFReader:
    """Every tensor of the GGUF at ``path`` is ``expected``'s, encoded as gguf-py encodes it."""
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == set(expected)
    for t in reader.tensors:
        want = expected[t.name]
        if want.ndim == 1 or t.name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            assert t.tensor_type == Q.F32, t.name
            stored = want.astype(np.float32)
        else:
            qtype = TYPES[gguf_type] if gguf_type != "q8_0" or want.shape[-1] % 32 == 0 else Q.F16
            assert t.tensor_type == qtype, t.name
            stored = gguf.quants.quantize(want.astype(np.float32), qtype)
        assert np.asarray(t.data).tobytes() == np.ascontiguousarray(stored).tobytes(), t.name
    return reader


def _keys(reader: gguf.GGUFReader, arch: str) -> dict[str, object]:
    return {k.removeprefix(f"{arch}."): reader.fields[k].contents() for k in reader.fields if "expert" in k}


def _same_logits(out: Path, merged: Path) -> None:
    """transformers reads the GGUF at ``out`` (F16 matrices) as the safetensors merge ``merged`` with its matrices
    rounded to float16 (routers stay float32), and both give the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32, config=config)
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(param.half().float())
    state, expected = model.state_dict(), reference.state_dict()
    assert [n for n in expected if not torch.equal(state[n], expected[n])] == []
    ids = torch.tensor([[1, 5, 17, 30, 2, 11]])
    with torch.no_grad():
        got, want = model.eval()(ids).logits, reference.eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("gguf_type", ["f16", pytest.param("bf16", marks=pytest.mark.slow), "q8_0"])
def test_a_qwen3moe_merge_of_a_gguf_and_a_safetensors_parent_is_written_with_its_experts_stacked(
        tmp_path: Path, gguf_type: str) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=1)), Q.F32)
    write_gguf(b, "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=2)), Q.F16)
    model, values = decoded(b)  # parent b as safetensors: per-expert tensors, as Qwen3-MoE checkpoints store them
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in model.config.items()
                                                    if k != "quantization_config"}))
    save_file(values, folder / "model.safetensors")
    config = write_config(tmp_path / "c.yml", {"merge_method": "ties", "base_model": str(a), "dtype": "float32",
                                                "models": [{"model": str(folder),
                                                            "parameters": {"weight": 0.7, "density": 0.5}}]})
    merged, out = tmp_path / "merged", tmp_path / "out"  # in this process: the suite's time is short
    api.run(config, merged, settings=api.Settings(state_dir=tmp_path / "s1", output=api.Output(copy_tokenizer=False)))
    api.run(config, out, settings=api.Settings(state_dir=tmp_path / "s2", output=api.Output(out_type="gguf",
                                                                                            gguf_type=gguf_type)))
    with readers_built_once():  # the file parsed once, for the test's reading and transformers'
        reader = _check_tensors(out / "model.gguf", _expected("qwen3moe", load_file(merged / "model.safetensors")),
                                gguf_type)
        exps = {t.name: [int(x) for x in t.shape] for t in reader.tensors if "_exps" in t.name}
        assert exps["blk.1.ffn_down_exps.weight"] == [512, 256, 3]  # ne: [n_ff, n_embd, E]
        assert _keys(reader, "qwen3moe") == {"expert_count": 3, "expert_used_count": 2,
                                             "expert_feed_forward_length": 512}
        plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type=gguf_type)))
        assert plan.total_bytes == (out / "model.gguf").stat().st_size
        assert f"matrices {gguf_type.upper()}" in (out / "README.md").read_text()
        if gguf_type == "f16":
            _same_logits(out, merged)


def _tiny(root: Path, arch: str, count: int) -> list[Path]:
    """``count`` tiny dense models (hidden 64, two layers) with SmolLM2's tokenizer (a byte-level BPE llama.cpp's
    table names), as mergekit-moe's bases and experts."""
    from realmodel import smollm2_folder
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = smollm2_folder()
    paths = []
    for i in range(count):
        torch.manual_seed(40 + i)
        config = AutoConfig.for_model(arch, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
                                      max_position_embeddings=128, tie_word_embeddings=arch == "qwen3",
                                      bos_token_id=1, eos_token_id=2)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        path = root / f"{arch}{i}"
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, path / name)
        paths.append(path)
    return paths


# mergekit-moe's output architectures a GGUF output writes: (source family, config extras, GGUF architecture, keys)
MOE_KINDS = {
    "qwen3_moe": ("qwen3", {}, "qwen3moe",
                  {"expert_count": 2, "expert_used_count": 2, "expert_feed_forward_length": 64}),
    "qwen2_moe": ("qwen2", {"architecture": "qwen", "shared_experts": [{"residual_scale": 0.5}]}, "qwen2moe",
                  {"expert_count": 2, "expert_used_count": 2, "expert_feed_forward_length": 64,
                   "expert_shared_feed_forward_length": 64}),
    "mixtral": ("llama", {}, "llama", {"expert_count": 2, "expert_used_count": 2}),
}


@pytest.mark.parametrize("kind", ["qwen3_moe", *(pytest.param(k, marks=pytest.mark.slow) for k in ("qwen2_moe",
                                                                                                  "mixtral"))])
def test_a_mergekit_moe_output_is_written_as_gguf(tmp_path: Path, kind: str) -> None:
    family, extra, arch, keys = MOE_KINDS[kind]
    base, other = _tiny(tmp_path, family, 2)
    shared = [{"source_model": str(base), **s} for s in extra.pop("shared_experts", [])]  # type: ignore[attr-defined]
    doc = {"base_model": str(base), "gate_mode": "random", "dtype": "float32", **extra,
           "experts": [{"source_model": str(base)}, {"source_model": str(other)}],
           **({"shared_experts": shared} if shared else {})}
    config = write_config(tmp_path / "moe.yml", doc)
    merged, out = tmp_path / "merged", tmp_path / "out"
    api.run(config, merged, settings=api.Settings(state_dir=tmp_path / "s1"))
    api.run(config, out, settings=api.Settings(state_dir=tmp_path / "s2", output=api.Output(out_type="gguf",
                                                                                            gguf_type="f16")))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "mergekit_moe_config.yml", "model.gguf",
                                                     "resumerge-manifest.json"]
    with readers_built_once():  # the file parsed once (SmolLM2's vocabulary), for the test's reading and transformers'
        reader = _check_tensors(out / "model.gguf", _expected(arch, load_file(merged / "model.safetensors"), 4, 2),
                                "f16")
        assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == arch
        assert _keys(reader, arch) == keys
        if arch != "llama":  # transformers reads a llama GGUF as a dense Llama, experts aside
            _same_logits(out, merged)


def mixtral_pair(root: Path) -> list[Path]:
    """Two tiny Mixtral checkpoints as transformers saves them (experts one by one), SmolLM2's tokenizer beside."""
    from realmodel import smollm2_folder
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
                                  num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=128)
    paths = []
    for i in range(2):
        torch.manual_seed(i)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / f"x{i}")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm2_folder() / name, root / f"x{i}" / name)
        paths.append(root / f"x{i}")
    return paths


@pytest.mark.slow
def test_a_merge_of_mixtral_checkpoints_is_written_as_a_llama_gguf_with_experts(tmp_path: Path) -> None:
    """transformers saves Mixtral's experts one by one (``block_sparse_moe.experts.e.w1``, ``w3``, ``w2``): each is
    merged alone (slerp, not elementwise) and written as its slice of the gate, up and down stacks; q/k permuted."""
    paths = mixtral_pair(tmp_path)
    doc = {"merge_method": "slerp", "base_model": str(paths[0]), "dtype": "float32", "parameters": {"t": 0.4},
           "models": [{"model": str(p)} for p in paths]}
    merge = write_config(tmp_path / "c.yml", doc)
    merged, out = tmp_path / "merged", tmp_path / "out"
    api.run(merge, merged, settings=api.Settings(state_dir=tmp_path / "s1"))
    api.run(merge, out, settings=api.Settings(state_dir=tmp_path / "s2", output=api.Output(out_type="gguf",
                                                                                           gguf_type="q8_0")))
    reader = _check_tensors(out / "model.gguf", _expected("llama", load_file(merged / "model.safetensors"), 4, 2),
                            "q8_0")
    assert _keys(reader, "llama") == {"expert_count": 3, "expert_used_count": 2}


def test_the_slices_of_a_stack_lie_end_to_end_whatever_their_size(tmp_path: Path) -> None:
    """Three Q8_0 expert slices of 102 bytes each (not a multiple of the alignment) make one GGUF tensor of 306
    bytes, padded after the last slice only: a file written part by part at the shard layout's offsets is read by
    gguf-py as the stack and the tensor after it."""
    from resumerge.outputs.gguf.layout import STRING, TensorInfo, Value, plan_layout, shard_layout

    rng = np.random.default_rng(0)
    experts = [rng.standard_normal((3, 32)).astype(np.float32) for _ in range(3)]
    slices = [gguf.quants.quantize(e, Q.Q8_0) for e in experts]
    norm = rng.standard_normal(32).astype(np.float32)
    layout = plan_layout([("general.architecture", Value(STRING, "qwen3moe"))],
                         [TensorInfo("blk.0.ffn_gate_exps.weight", (3, 3, 32), Q.Q8_0, 306),
                          TensorInfo("output_norm.weight", (32,), Q.F32, 128)])
    parts = [*((f"blk.0.ffn_gate_exps.weight#{e}", "U8", (3, 34)) for e in range(3)),
             ("output_norm.weight", "F32", (32,))]
    planned = shard_layout(layout.header, parts, layout.file_size)
    assert [t.offset for t in planned.order] == [0, 102, 204, 320] == [0, 102, 204, layout.offsets[1]]
    data = bytearray(layout.file_size)
    data[:len(layout.header)] = layout.header
    for t, value in zip(planned.order, [*slices, norm]):
        at = len(layout.header) + t.offset
        data[at:at + t.nbytes] = value.tobytes()
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    stack, after = reader.tensors
    assert np.array_equal(gguf.quants.dequantize(stack.data, stack.tensor_type),
                          np.stack([gguf.quants.dequantize(s, Q.Q8_0) for s in slices]))
    assert np.array_equal(after.data, norm)


@pytest.mark.parametrize("said", ["absent", "false"])
def test_a_qwen3moe_that_does_not_renormalise_its_experts_weights_is_refused_as_gguf(tmp_path: Path,
                                                                                      said: str) -> None:
    """llama.cpp's qwen3moe divides the chosen experts' routing weights by their sum whatever the GGUF says;
    transformers does so only with norm_topk_prob (false when absent): such a model written as a qwen3moe GGUF
    would compute another model than the merge, so it is refused at plan time (exit 2), nothing written."""
    from resumerge.errors import ModelInputError

    source = tmp_path / "a.gguf"
    write_gguf(source, "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=1)), Q.F32)
    model, values = decoded(source)
    folder = tmp_path / "a"
    folder.mkdir()
    config = {k: v for k, v in model.config.items() if k not in ("quantization_config", "norm_topk_prob")}
    (folder / "config.json").write_text(json.dumps({**config, **({"norm_topk_prob": False} if said == "false"
                                                                 else {})}))
    save_file(values, folder / "model.safetensors")
    merge = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "dtype": "float32",
                                               "models": [{"model": str(folder)}]})
    out = tmp_path / "out"
    with pytest.raises(ModelInputError) as refused:
        api.run(merge, out, settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf")))
    line = refused.value.one_line()
    said_line = "has no norm_topk_prob (transformers reads false)" if said == "absent" else "says norm_topk_prob: false"
    assert f"the output's config.json {said_line}, and llama.cpp's qwen3moe always divides the 2 chosen" in line
    assert "--out-type safetensors" in line and "set norm_topk_prob: true" in line and "\n" not in line
    assert refused.value.exit_code == 2
    assert not (out / "model.gguf").exists()


def _moe_config(**extra: object) -> dict[str, object]:
    return {"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, **extra}


@pytest.mark.parametrize(("arch", "config", "refused"), [
    ("qwen3moe", _moe_config(norm_topk_prob=True), None),
    ("qwen3moe", _moe_config(), r"no norm_topk_prob \(transformers reads false\).*always divides the 2 chosen"),
    ("qwen3moe", _moe_config(norm_topk_prob=False, num_experts_per_tok=4), None),  # all chosen: weights sum to 1
    ("qwen2moe", _moe_config(), None),
    ("qwen2moe", _moe_config(norm_topk_prob=True), r"norm_topk_prob: true.*llama.cpp's qwen2moe never divides"),
    ("qwen2moe", _moe_config(norm_topk_prob=True, num_experts_per_tok=4), None),
    ("qwen3moe", _moe_config(norm_topk_prob=True, mlp_only_layers=[1]), r"makes layer 1 dense"),
    ("qwen2moe", _moe_config(decoder_sparse_step=2), r"makes layers 0, 2 dense"),
    ("qwen3moe", _moe_config(norm_topk_prob=True, mlp_only_layers=[7]), None),  # no such layer
    ("llama", {"num_local_experts": 8, "num_experts_per_tok": 2}, None),  # Mixtral: renormalised in both
])
def test_a_mixture_of_experts_llama_cpp_would_route_otherwise_is_refused(
        arch: str, config: dict[str, object], refused: str | None) -> None:
    from resumerge.errors import ModelInputError
    from resumerge.inputs.gguf.names import check_routing
    from resumerge.merge.plan.architecture import dense_mlp_layers

    found = dense_mlp_layers(config)
    dense = found[1] if found is not None else ()
    if refused is None:
        check_routing(arch, config, dense)
        return
    with pytest.raises(ModelInputError, match=refused):
        check_routing(arch, config, dense)
