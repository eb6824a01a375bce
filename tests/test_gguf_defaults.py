"""A GGUF output of a config.json that leaves a key out holds what transformers makes of that key when it loads the
config (its configuration class for the family), so llama.cpp runs the model the safetensors merge is; an attention
width so completed that the tensors contradict is refused at plan time (transformers would not load them either)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ggufmodels import HEAD_DIM, HEADS, KV, Q, decoded, hf_tensors, metadata_of, to_gguf, write_gguf
from safetensors.torch import save_file
from support import cli, write_config

from resumerge import api
from resumerge.errors import InputError, ModelInputError
from resumerge.inputs.gguf.hparams import KNOWN_DEFAULTS, gguf_hparams, known_defaults, transformers_defaults
from resumerge.inputs.gguf.names import gguf_metadata

_SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
          "vocab_size": 40}


def _merge(tmp_path: Path, arch: str, drop: tuple[str, ...], model_type: str | None = None) -> Path:
    """A merge of a tiny ``arch`` model (4 heads of 64, 2 key heads) whose config.json lacks ``drop`` (and says
    ``model_type``, if given), the base, with its GGUF (which gives the output its tokenizer)."""
    source = tmp_path / "a.gguf"
    write_gguf(source, arch, to_gguf(arch, hf_tensors(arch, seed=1)), Q.F32)
    model, values = decoded(source)
    folder = tmp_path / "a"
    folder.mkdir()
    config = {k: v for k, v in model.config.items() if k not in ("quantization_config", *drop)}
    (folder / "config.json").write_text(json.dumps({**config, **({"model_type": model_type} if model_type else {})}))
    save_file(values, folder / "model.safetensors")
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "base_model": str(folder),
                                              "models": [{"model": str(folder), "parameters": {"weight": 1.0}},
                                                         {"model": str(source), "parameters": {"weight": 1.0}}]})


def _run(tmp_path: Path, merge: Path) -> Path:
    out = tmp_path / "out"
    api.run(merge, out, settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf")))
    return out / "model.gguf"


@pytest.mark.parametrize(("arch", "model_type", "drop", "key", "value"), [
    # transformers' max_position_embeddings is the family's (the writer's fallback was 4096 for every family)
    ("llama", None, "max_position_embeddings", "llama.context_length", 2048),
    ("llama", "mistral", "max_position_embeddings", "llama.context_length", 131072),
    ("qwen3", None, "max_position_embeddings", "qwen3.context_length", 32768),
    ("gemma3", None, "max_position_embeddings", "gemma3.context_length", 131072),
])
def test_an_absent_key_is_written_as_transformers_reads_it(
        tmp_path: Path, arch: str, model_type: str | None, drop: str, key: str, value: float) -> None:
    fields = metadata_of(_run(tmp_path, _merge(tmp_path, arch, (drop,), model_type)))
    assert fields[key].parts[-1][0] == pytest.approx(value)


@pytest.mark.parametrize(("arch", "drop", "said"), [
    # Qwen3's and Gemma's transformers head_dim is 128 / 256, the tensors' 64 (the writer wrote hidden / heads)
    ("qwen3", "head_dim", "no head_dim, for which transformers would use 128, and the tensors' query width is 256"),
    ("gemma3", "head_dim", "no head_dim, for which transformers would use 256, and the tensors' query width is 256"),
    # Qwen3's transformers num_key_value_heads is 32, Llama's the head count (4): the tensors have 2
    ("qwen3", "num_key_value_heads", "no num_key_value_heads, for which transformers would use 32, and the "
                                     f"tensors' key width is {KV * HEAD_DIM}"),
    ("llama", "num_key_value_heads", f"no num_key_value_heads, for which transformers would use {HEADS}, and the "
                                     f"tensors' key width is {KV * HEAD_DIM}"),
])
def test_an_absent_attention_width_transformers_would_contradict_is_refused(
        tmp_path: Path, arch: str, drop: str, said: str) -> None:
    merge = _merge(tmp_path, arch, (drop,))
    with pytest.raises(ModelInputError) as refused:
        _run(tmp_path, merge)
    message = refused.value.one_line()
    assert said in message and "\n" not in message, message
    assert refused.value.exit_code == 2
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_the_cli_refuses_an_absent_head_dim_transformers_contradicts_in_one_line(tmp_path: Path) -> None:
    merge = _merge(tmp_path, "qwen3", ("head_dim",))
    done = cli("run", merge, tmp_path / "out", "--state-dir", tmp_path / "s", "--out-type", "gguf")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if "head_dim" in ln]) == 1, done.stderr


@pytest.mark.parametrize(("config", "keys"), [
    # Mixtral's rms_norm_eps and rope_theta (the writer's fallbacks were 1e-6 and 10000)
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
     {"llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 1e6, "llama.context_length": 131072,
      "llama.attention.head_count_kv": 8}),
    # Qwen3's head_dim is 128 whatever the width (the writer's was hidden / heads, 64)
    ({"model_type": "qwen3"}, {"qwen3.attention.key_length": 128, "qwen3.attention.value_length": 128,
                               "qwen3.attention.head_count_kv": 32}),
    # Qwen2's num_key_value_heads left out is 32; null, the head count
    ({"model_type": "qwen2"}, {"qwen2.attention.head_count_kv": 32, "qwen2.attention.key_length": 64}),
    ({"model_type": "qwen2", "num_key_value_heads": None}, {"qwen2.attention.head_count_kv": 4}),
    # Llama's is the head count, its head_dim the width over the heads
    ({"model_type": "llama"}, {"llama.attention.head_count_kv": 4, "llama.attention.key_length": 64}),
    ({"model_type": "gemma2"}, {"gemma2.attention.key_length": 256, "gemma2.attention.sliding_window": 4096,
                                "gemma2.attn_logit_softcapping": 50.0}),
    ({"model_type": "gemma3_text"}, {"gemma3.rope.freq_base": 1e6, "gemma3.rope.freq_base_swa": 1e4}),
])
def test_the_keys_of_a_config_without_them_are_transformers_values(config: dict[str, Any],
                                                                    keys: dict[str, float]) -> None:
    done = gguf_hparams({**_SHAPE, **config})
    arch = {"mixtral": "llama", "gemma3_text": "gemma3"}.get(config["model_type"], config["model_type"])
    written = {key: value for key, (_, value) in gguf_metadata(arch, done)}
    assert {key: written.get(key) for key in keys} == pytest.approx(keys)


def test_a_completed_width_the_tensors_agree_with_is_taken() -> None:
    """A Qwen3 of 4 heads of 128 over a width of 256 (as Qwen3-0.6B: 16 of 128 over 1024) without head_dim."""
    done = gguf_hparams({**_SHAPE, "model_type": "qwen3", "num_key_value_heads": 2}, (4 * 128, 2 * 128))
    assert done["head_dim"] == 128


def test_a_missing_key_without_transformers_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without transformers the value transformers would read is unknown: refused, not guessed."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # its import raises ImportError
    with pytest.raises(InputError, match=r"has no max_position_embeddings, .* transformers is not installed") as e:
        gguf_hparams({**_SHAPE, "model_type": "llama", "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                      "rope_theta": 1e4, "head_dim": 64})
    assert e.value.exit_code == 2 and "\n" not in e.value.one_line()


@pytest.mark.parametrize("model_type", sorted(KNOWN_DEFAULTS))
@pytest.mark.parametrize("shape", [{}, {"hidden_size": 2048, "num_attention_heads": 16}, {"head_dim": None},
                                   {"hidden_size": 96, "num_attention_heads": 3, "rope_theta": None}])
def test_the_defaults_known_without_transformers_are_transformers_own(model_type: str, shape: dict[str, Any]) -> None:
    """The keys a plain llama's config.json leaves out are completed without importing transformers: with the very
    values transformers' configuration class gives them."""
    config = {**_SHAPE, "model_type": model_type, **shape}
    keys = list(KNOWN_DEFAULTS[model_type])
    known = known_defaults(config, keys)
    assert (known is None) == any(k in config for k in keys)  # a null is transformers' to read
    assert known in (None, transformers_defaults(config, keys))
    assert known_defaults({**config, "rope_scaling": {"rope_type": "default"}}, keys) is None


def test_a_llama_gguf_is_planned_without_importing_transformers(tmp_path: Path) -> None:
    """A llama config.json without head_dim and rope_theta (as the K-quant route's bench models'): transformers'
    import was 1.8 of its GGUF plan's 2.1 s, for two values known without it. The plan's keys are unchanged."""
    merge = _merge(tmp_path, "llama", ("head_dim", "rope_theta"))
    probe = (
        "import sys\n"
        "from resumerge import api\n"
        f"plan = api.plan_merge({str(merge)!r}, api.Settings(output=api.Output(out_type='gguf', gguf_type='q8_0')))\n"
        "print(len(plan.tensors) > 0, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "True []", done.stdout + done.stderr
    fields = metadata_of(_run(tmp_path, merge))
    assert fields["llama.rope.freq_base"].parts[-1][0] == pytest.approx(10000.0)
    assert fields["llama.attention.key_length"].parts[-1][0] == HEAD_DIM
