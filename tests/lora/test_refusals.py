"""What open_adapter and check_adapter refuse, each with a one-line exit-2 error naming the file and tensor."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.gen import make_adapter
from resumerge.errors import HostileFileError, ModelInputError, ResumergeError, exit_code_for
from resumerge.inputs.adapters import Adapter, check_adapter, open_adapter
from resumerge.inputs.safetensors_format import read_header

PREFIX = "base_model.model."
Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, llama_base: Path) -> Path:
    """A valid adapter (q_proj and v_proj, r=2) that each test copies and damages."""
    path = tmp_path_factory.mktemp("good") / "adapter"
    make_adapter(llama_base, path, r=2, alpha=4, targets=["q_proj", "v_proj"])
    return path


@pytest.fixture
def damaged(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "adapter"))


def refused(kind: type[ResumergeError], call: Callable[[], Any], *fragments: str) -> ResumergeError:
    """Assert ``call`` raises ``kind`` with exit code 2, a single line holding every fragment."""
    with pytest.raises(kind) as info:
        call()
    line = info.value.one_line()
    assert exit_code_for(info.value) == 2 and "\n" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return info.value


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "adapter_config.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


class _Payload:
    """Unpickling this creates the marker file: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickle_only_adapter_is_refused_and_never_unpickled(damaged: Path, tmp_path: Path) -> None:
    (damaged / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (damaged / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="models[1].model"),
            "models[1].model: ", "adapter_model.bin", "pickle", "never loads")
    assert not marker.exists()
    # The payload is live: loading it would have created the marker.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe))).close()
    assert probe.exists()


def test_missing_folder_config_or_weights(tmp_path: Path, damaged: Path, llama_base: Path) -> None:
    refused(ModelInputError, lambda: open_adapter(tmp_path / "nope", yaml_path="m"), "not found")
    refused(ModelInputError, lambda: open_adapter(llama_base, yaml_path="m"), "adapter_config.json", "full model")
    (damaged / "adapter_model.safetensors").unlink()
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), "no adapter_model.safetensors")


@pytest.mark.parametrize("header", [
    struct.pack("<Q", 1 << 40) + b"{}",  # header length past the end of the file
    struct.pack("<Q", 6) + b"{nope}",  # not JSON
    struct.pack("<Q", 2) + b"{}" + b"\0" * 8,  # data nobody claims
])
def test_malformed_header_is_hostile(damaged: Path, header: bytes) -> None:
    (damaged / "adapter_model.safetensors").write_bytes(header)
    refused(HostileFileError, lambda: open_adapter(damaged, yaml_path="models[3].model"),
            "models[3].model: ", "adapter_model.safetensors")


def test_header_that_lies_about_a_factor_size(damaged: Path) -> None:
    path = damaged / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8:8 + length])
    name = f"{PREFIX}{Q0}.lora_A.weight"
    doc[name]["shape"] = [3, 32]  # the stored bytes hold (2, 32)
    text = json.dumps(doc, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    path.write_bytes(bytes(data[:8]) + text + bytes(data[8 + length:]))
    refused(HostileFileError, lambda: open_adapter(damaged, yaml_path="m"), name)


def test_rank_disagreeing_with_config_or_between_factors(damaged: Path) -> None:
    edit_config(damaged, r=3)
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), f"{Q0}.lora_A.weight", "rank 3")
    edit_config(damaged, r=2)
    edit_tensors(damaged, lambda t: t.update({f"{PREFIX}{Q0}.lora_B.weight": torch.zeros(32, 3)}))
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), "[32, 3]", "rank 2")


def test_rank_pattern_is_honoured_when_checking_shapes(damaged: Path) -> None:
    edit_config(damaged, rank_pattern={"layers.0.self_attn.q_proj": 5})
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), Q0, "rank 5")


@pytest.mark.parametrize("edit, fragments", [
    (lambda t: t.pop(f"{PREFIX}{Q0}.lora_B.weight"), ("lora_B", "missing")),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2)}), ("does not start with",)),
    (lambda t: t.update({f"{PREFIX}model.layers.0.rotary.inv_freq": torch.zeros(2)}), ("neither a LoRA",)),
    (lambda t: t.update({f"{PREFIX}{Q0}.lora_magnitude_vector": torch.zeros(32)}), ("DoRA",)),
    (lambda t: t.update({f"{PREFIX}{Q0}.lora_B.bias": torch.zeros(32)}), ("lora_bias",)),
    (lambda t: t.update({f"{PREFIX}lm_head.modules_to_save.default.weight": torch.zeros(2)}), ("neither a LoRA",)),
    (lambda t: t.update({f"{PREFIX}model.norm.base_layer.weight": torch.zeros(2)}), ("no LoRA factors",)),
    (lambda t: t.update({f"{PREFIX}{Q0}.weight": torch.zeros(32, 32)}), ("lacks .base_layer",)),
    (lambda t: t.update({f"{PREFIX}{Q0}.lora_A.weight": torch.zeros(2, 32, dtype=torch.int32)}), ("2-D float",)),
    (lambda t: t.update({f"{PREFIX}{Q0}.lora_A.weight": torch.zeros(2, 32, 1)}), ("2-D float",)),
])
def test_unknown_or_unsupported_tensors(
    damaged: Path, edit: Callable[[dict[str, torch.Tensor]], object], fragments: tuple[str, ...]
) -> None:
    edit_tensors(damaged, edit)
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), *fragments)


@pytest.mark.parametrize("changes, fragments", [
    ({"peft_type": "IA3"}, ("'IA3'", "only LoRA")),
    ({"peft_type": None}, ("peft_type None",)),
    ({"use_dora": True}, ("DoRA",)),
    ({"lora_bias": True}, ("lora_bias",)),
    ({"layer_replication": [[0, 2], [1, 3]]}, ("layer_replication",)),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, ("target_parameters",)),
    ({"init_lora_weights": "pissa_niter_4"}, ("pissa", "convert")),
    ({"init_lora_weights": "loftq"}, ("loftq",)),
    ({"init_lora_weights": "something_new"}, ("unknown init_lora_weights",)),
    ({"shiny_new_option": {"on": True}}, ("'shiny_new_option'", "does not know")),
    ({"r": 0}, ("positive integer",)),
    ({"r": True}, ("positive integer",)),
    ({"lora_alpha": "8"}, ("finite number",)),
    ({"use_rslora": "yes"}, ("true or false",)),
    ({"rank_pattern": {"(a+)+$": 2}}, ("runaway regex",)),
    ({"rank_pattern": {"q_proj[": 2}}, ("not a regular expression",)),
    ({"alpha_pattern": ["q_proj"]}, ("as an object",)),
])
def test_refused_configs(damaged: Path, changes: dict[str, object], fragments: tuple[str, ...]) -> None:
    edit_config(damaged, **changes)
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="models[0]"),
            "models[0]: ", "adapter_config.json", *fragments)


def test_unset_unknown_options_and_harmless_ones_are_accepted(damaged: Path) -> None:
    edit_config(damaged, shiny_new_option=None, another=False, lora_dropout=0.1, modules_to_save=None,
                bias="none", init_lora_weights="gaussian", target_modules="all-linear")
    assert len(open_adapter(damaged, yaml_path="m").targets) == 8


def test_config_not_json_or_not_an_object(damaged: Path) -> None:
    (damaged / "adapter_config.json").write_text("{")
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), "not valid JSON")
    (damaged / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), "adapter_config.json")
    (damaged / "adapter_config.json").write_text("[]")
    refused(ModelInputError, lambda: open_adapter(damaged, yaml_path="m"), "JSON object")


def test_a_real_dora_adapter_is_refused(tmp_path: Path, llama_base: Path) -> None:
    make_adapter(llama_base, tmp_path / "dora", r=2, alpha=4, targets=["q_proj"], use_dora=True)
    refused(ModelInputError, lambda: open_adapter(tmp_path / "dora", yaml_path="m"), "DoRA (use_dora)")


def test_a_tokenizer_link_leading_outside_is_hostile_and_a_weights_link_is_followed(damaged: Path,
                                                                                     tmp_path: Path) -> None:
    """A tokenizer file is copied into OUT as it is; the adapter's weights are read as tensors, never copied."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hf_xxx"}')
    os.symlink(secret, damaged / "tokenizer_config.json")
    refused(HostileFileError, lambda: open_adapter(damaged, yaml_path="m"), "tokenizer_config.json", "outside")
    os.unlink(damaged / "tokenizer_config.json")
    before = open_adapter(damaged, yaml_path="m")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(damaged / "adapter_model.safetensors", outside)
    os.symlink(outside, damaged / "adapter_model.safetensors")
    assert open_adapter(damaged, yaml_path="m").files == before.files


# ---- check_adapter -----------------------------------------------------------------------------------------


def base_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    found = {}
    for path in directory.glob("*.safetensors"):
        found.update({n: (e.dtype, e.shape) for n, e in read_header(path).tensors.items()})
    return found


def test_check_accepts_the_base_it_was_trained_on(good: Path, llama_base: Path) -> None:
    check_adapter(open_adapter(good, yaml_path="m"), base_tensors(llama_base), yaml_path="m")


def test_target_missing_from_a_smaller_base(good: Path, llama_base: Path) -> None:
    tensors = {n: v for n, v in base_tensors(llama_base).items() if not n.startswith("model.layers.3.")}
    refused(ModelInputError, lambda: check_adapter(open_adapter(good, yaml_path=""), tensors, yaml_path="models[2]"),
            "models[2]: ", "model.layers.3.self_attn.q_proj.weight", "does not have")


def test_target_shape_mismatch_names_tensor_and_shapes(good: Path, llama_base: Path) -> None:
    tensors = base_tensors(llama_base)
    tensors["model.layers.2.self_attn.v_proj.weight"] = ("F32", (24, 32))
    refused(ModelInputError, lambda: check_adapter(open_adapter(good, yaml_path=""), tensors, yaml_path="m"),
            "model.layers.2.self_attn.v_proj.weight", "[16, 32]", "[24, 32]")
    tensors = base_tensors(llama_base)
    tensors["model.layers.2.self_attn.v_proj.weight"] = ("F32", (32, 16))  # stored transposed
    refused(ModelInputError, lambda: check_adapter(open_adapter(good, yaml_path=""), tensors, yaml_path="m"),
            "fan_in_fan_out=true")
    tensors = base_tensors(llama_base)
    tensors["model.layers.0.self_attn.q_proj.weight"] = ("I8", (32, 32))
    refused(ModelInputError, lambda: check_adapter(open_adapter(good, yaml_path=""), tensors, yaml_path="m"),
            "I8", "quantised")


def test_replacements_must_exist_with_the_same_shape(damaged: Path, llama_base: Path) -> None:
    edit_tensors(damaged, lambda t: t.update({f"{PREFIX}lm_head.weight": torch.zeros(70, 32)}))
    adapter: Adapter = open_adapter(damaged, yaml_path="")
    refused(ModelInputError, lambda: check_adapter(adapter, base_tensors(llama_base), yaml_path="m"),
            "lm_head.weight", "[70, 32]", "[64, 32]", "resized vocabulary")
    tied = {n: v for n, v in base_tensors(llama_base).items() if n != "lm_head.weight"}
    refused(ModelInputError, lambda: check_adapter(adapter, tied, yaml_path="m"), "ties lm_head")
    # A checkpoint that names tensors without the module prefix the adapter uses (as GPT-2's hub files do).
    unprefixed = {n.removeprefix("model."): v for n, v in base_tensors(llama_base).items()}
    refused(ModelInputError, lambda: check_adapter(adapter, unprefixed, yaml_path="m"),
            "does not have", "without the 'model.' prefix")
