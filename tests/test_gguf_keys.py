"""A GGUF output's ``{arch}.*`` keys come from the output's config.json: a key the family needs that is absent, or a
value of the wrong type, is refused at plan time in one line naming config.json and the key (exit 2, no file
written), not a KeyError in the key writer; a key transformers defaults takes transformers' default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ggufmodels import Q, decoded, hf_tensors, to_gguf, write_gguf
from safetensors.torch import save_file
from support import cli, write_config

from resumerge import api
from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.hparams import CHOSEN_DEFAULT, DENSE_WIDTH_DEFAULT, gguf_hparams
from resumerge.inputs.gguf.names import gguf_metadata


def _merge(tmp_path: Path, drop: tuple[str, ...] = (), **said: Any) -> Path:
    """A passthrough merge of a tiny qwen3moe (3 experts, 2 chosen) whose config.json lacks ``drop`` and says
    ``said``."""
    source = tmp_path / "a.gguf"
    write_gguf(source, "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=1)), Q.F32)
    model, values = decoded(source)
    folder = tmp_path / "a"
    folder.mkdir()
    config = {k: v for k, v in model.config.items() if k not in ("quantization_config", *drop)}
    (folder / "config.json").write_text(json.dumps({**config, **said}))
    save_file(values, folder / "model.safetensors")
    return write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "dtype": "float32",
                                              "models": [{"model": str(folder)}]})


@pytest.mark.parametrize(("drop", "said", "line"), [
    # transformers' default (8 chosen) cannot route 3 experts
    (("num_experts_per_tok",), {}, "config.json has no num_experts_per_tok (how many experts route each token), "
                                   "and transformers' default for a qwen3_moe, 8, exceeds its 3 experts"),
    ((), {"num_experts_per_tok": "2"}, 'config.json says num_experts_per_tok: "2", where a positive whole number'),
    ((), {"num_experts_per_tok": True}, "config.json says num_experts_per_tok: true, where a positive whole"),
    ((), {"num_experts_per_tok": 9}, "config.json says num_experts_per_tok: 9, more than its 3 experts"),
    ((), {"moe_intermediate_size": 16.5}, "config.json says moe_intermediate_size: 16.5, where a positive whole"),
    ((), {"norm_topk_prob": "true"}, 'config.json says norm_topk_prob: "true", where true or false belongs'),
    ((), {"rms_norm_eps": "1e-6"}, 'config.json says rms_norm_eps: "1e-6", where a number belongs'),
    (("hidden_size",), {}, "config.json has no hidden_size, which a GGUF output of a qwen3_moe needs"),
    # a layer list that is not one (transformers' `layer_idx in` fails on a number, misreads a string)
    ((), {"mlp_only_layers": 1}, "config.json says mlp_only_layers: 1, where a list of layer numbers belongs"),
    ((), {"mlp_only_layers": "1"}, 'config.json says mlp_only_layers: "1", where a list of layer numbers belongs'),
    ((), {"decoder_sparse_step": 0}, "config.json says decoder_sparse_step: 0, where a positive whole number"),
    (("num_experts",), {}, "config.json has no num_experts, which a GGUF output of a qwen3_moe needs"),
])
def test_a_config_json_the_gguf_keys_cannot_be_written_from_is_refused_at_plan_time(
        tmp_path: Path, drop: tuple[str, ...], said: dict[str, Any], line: str) -> None:
    merge = _merge(tmp_path, drop, **said)
    out = tmp_path / "out"
    with pytest.raises(ModelInputError) as refused:
        api.run(merge, out, settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf")))
    message = refused.value.one_line()
    assert line in message and "\n" not in message
    assert refused.value.exit_code == 2
    assert not (out / "model.gguf").exists()


def test_the_cli_refuses_a_moe_without_num_experts_per_tok_in_one_line(tmp_path: Path) -> None:
    merge = _merge(tmp_path, ("num_experts_per_tok",))
    out = tmp_path / "out"
    done = cli("run", merge, out, "--state-dir", tmp_path / "s", "--out-type", "gguf")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "KeyError" not in done.stderr
    assert "config.json has no num_experts_per_tok" in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if "num_experts_per_tok" in ln]) == 1
    assert not (out / "model.gguf").exists()


@pytest.mark.parametrize(("config", "used"), [
    ({"model_type": "mixtral", "num_local_experts": 3}, 2),
    ({"model_type": "qwen2_moe", "num_experts": 4}, 4),
    ({"model_type": "qwen3_moe", "num_experts": 8, "norm_topk_prob": True}, 8),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 3}, 3),
])
def test_an_absent_num_experts_per_tok_is_transformers_default(config: dict[str, Any], used: int) -> None:
    """transformers reads a config.json without num_experts_per_tok with its class's default; so does the writer."""
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "vocab_size": 100}
    done = gguf_hparams({**shape, **config})
    arch = "llama" if config["model_type"] == "mixtral" else config["model_type"].replace("_", "")
    keys = dict(gguf_metadata(arch, done))
    assert keys[f"{arch}.expert_used_count"] == ("u32", used)


def test_a_qwen_moe_without_a_dense_width_takes_transformers_default() -> None:
    """Qwen-MoE's intermediate_size sizes only dense layers (none in a GGUF resumerge writes): absent, it is
    transformers' default, as transformers loads the model; Mixtral's sizes its experts and is refused."""
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    done = gguf_hparams({**shape, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2})
    assert done["intermediate_size"] == DENSE_WIDTH_DEFAULT["qwen3_moe"]
    with pytest.raises(ModelInputError, match=r"config\.json has no intermediate_size"):
        gguf_hparams({**shape, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})


def test_the_defaults_are_transformers_own() -> None:
    transformers = pytest.importorskip("transformers")
    for model_type, chosen in CHOSEN_DEFAULT.items():
        assert transformers.AutoConfig.for_model(model_type).num_experts_per_tok == chosen, model_type
    for model_type, width in DENSE_WIDTH_DEFAULT.items():
        assert transformers.AutoConfig.for_model(model_type).intermediate_size == width, model_type
