"""Differential tests against mergekit-moe 0.1.5: for each output kind and gate mode, every tensor (routers
included) has mergekit's bits, config.json reads back as mergekit's, and the output loads in transformers with no
missing or unexpected keys and generates mergekit's tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from resumerge import api
from tests.moe.models import SEED, llamas, oracle, qwen2s, qwen3s, same_bits, tensors, write
from tests.moe.passthread import passes_on_a_thread

pytestmark = [pytest.mark.oracle, pytest.mark.slow]  # slow: the module's fixture runs 24 merges

# name -> (config builder over (llamas, bf16 llamas, qwen3s), the class transformers loads, or None: remote code)
CASES = ("mixtral_random", "mixtral_uniform", "mixtral_cheap_embed", "qwen_moe", "deepseek", "qwen3_moe",
         "mixtral_hidden", "mixtral_hidden_avg", "qwen_moe_hidden_last", "qwen_moe_from_qwen2", "qwen3_moe_hidden",
         "deepseek_cheap_embed")


def _configs(m: list[Path], b: list[Path], q: list[Path], d: list[Path],
             q2: list[Path]) -> dict[str, dict[str, Any]]:
    prompted = [{"source_model": str(d[1]), "positive_prompts": ["hello world", "ab cd ef gh"],
                 "negative_prompts": ["xyz"]},
                {"source_model": str(d[2]), "positive_prompts": ["Zq rs"]},
                {"source_model": str(d[0]), "positive_prompts": ["Ab", "cd ef"]}]
    return {
        "qwen_moe_from_qwen2": {"base_model": str(q2[0]), "gate_mode": "uniform_random", "architecture": "qwen",
                                "experts": [{"source_model": str(q2[1]), "positive_prompts": ["a"]},
                                            {"source_model": str(q2[0]), "positive_prompts": ["b"]}],
                                "shared_experts": [{"source_model": str(q2[1]), "positive_prompts": ["c"],
                                                    "noise_scale": 0.0}]},
        "mixtral_hidden": {"base_model": str(d[0]), "gate_mode": "hidden", "experts": prompted},
        "mixtral_hidden_avg": {"base_model": str(d[0]), "gate_mode": "hidden_avg", "dtype": "bfloat16",
                               "experts": prompted},
        "qwen_moe_hidden_last": {"base_model": str(d[0]), "gate_mode": "hidden_last", "architecture": "qwen",
                                 "experts": prompted[:2],
                                 "shared_experts": [{"source_model": str(d[0]), "positive_prompts": ["q r s"]}]},
        "mixtral_random": {"base_model": str(m[0]), "gate_mode": "random", "dtype": "float32",
                           "experts": [{"source_model": str(m[1])}, {"source_model": str(m[2])},
                                       {"source_model": str(m[1])}]},
        "mixtral_uniform": {"base_model": str(m[0]), "gate_mode": "uniform_random", "dtype": "bfloat16",
                            "experts_per_token": 1,
                            "experts": [{"source_model": str(m[1]), "positive_prompts": ["abc"]},
                                        {"source_model": str(m[2]), "positive_prompts": ["def"],
                                         "residual_scale": 0.5}]},
        "mixtral_cheap_embed": {"base_model": str(b[0]), "gate_mode": "cheap_embed", "experts_per_token": 1,
                                "experts": [{"source_model": str(b[1]), "positive_prompts": ["hello world", "ab cd"],
                                             "negative_prompts": ["xyz"]},
                                            {"source_model": str(b[2]), "positive_prompts": ["Zq rs"]}]},
        "qwen_moe": {"base_model": str(m[0]), "gate_mode": "random", "architecture": "qwen",
                     "experts": [{"source_model": str(m[1])}, {"source_model": str(m[2])}],
                     "shared_experts": [{"source_model": str(m[0]), "residual_scale": 0.5}]},
        "deepseek": {"base_model": str(m[0]), "gate_mode": "uniform_random",
                     "experts": [{"source_model": str(m[1]), "positive_prompts": ["a"]},
                                 {"source_model": str(m[2]), "positive_prompts": ["b"]},
                                 {"source_model": str(m[1]), "positive_prompts": ["c"]}],
                     "shared_experts": [{"source_model": str(m[0])}]},
        "qwen3_moe_hidden": {"base_model": str(q[0]), "gate_mode": "hidden",
                             "experts": [{"source_model": str(q[1]), "positive_prompts": ["hello world", "ab"],
                                          "negative_prompts": ["xyz"]},
                                         {"source_model": str(q[0]), "positive_prompts": ["Zq rs"]}]},
        "deepseek_cheap_embed": {"base_model": str(b[0]), "gate_mode": "cheap_embed", "architecture": "deepseek",
                                 "experts": [{"source_model": str(b[1]), "positive_prompts": ["hello world"]},
                                             {"source_model": str(b[2]), "positive_prompts": ["Zq rs", "ab"]}],
                                 "shared_experts": [{"source_model": str(b[0])}]},
        "qwen3_moe": {"base_model": str(q[0]), "gate_mode": "random",
                      "experts": [{"source_model": str(q[0])}, {"source_model": str(q[1])}]},
    }


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(mergekit's output, resumerge's output) of every case. The four hidden-state passes run on a thread of this
    process (transformers is imported here already): their bits are the subject, not their process (six CPU
    seconds each to start)."""
    root = tmp_path_factory.mktemp("moe")
    configs = _configs(llamas(root / "f32"), llamas(root / "bf16", dtype=torch.bfloat16), qwen3s(root / "q3"),
                       llamas(root / "deep", layers=4), qwen2s(root / "q2"))
    paths = {name: write(root / f"{name}.yml", doc) for name, doc in configs.items()}
    with oracle([(paths[n], root / "mk" / n, ["--random-seed", str(SEED)]) for n in CASES]), passes_on_a_thread():
        for name in CASES:
            api.run(paths[name], root / "ours" / name, settings=api.Settings(state_dir=root / "state" / name,
                                                                             merging=api.Merging(random_seed=SEED)))
    return {n: (root / "mk" / n, root / "ours" / n) for n in CASES}


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_has_mergekits_bits(outputs: dict[str, tuple[Path, Path]], case: str) -> None:
    theirs, ours = (tensors(d) for d in outputs[case])
    assert sorted(ours) == sorted(theirs)
    differ = [name for name in theirs if not same_bits(theirs[name], ours[name])]
    assert differ == []


@pytest.mark.parametrize("case", CASES)
def test_config_reads_back_as_mergekits(outputs: dict[str, tuple[Path, Path]], case: str) -> None:
    theirs_dir, ours_dir = outputs[case]
    if case.startswith("deepseek"):  # remote code: compare the file's keys (transformers' bookkeeping aside)
        theirs = json.loads((theirs_dir / "config.json").read_text())
        ours = json.loads((ours_dir / "config.json").read_text())
        assert {k: v for k, v in ours.items() if k != "dtype"} == {k: theirs[k] for k in ours if k != "dtype"}
        routed = {"deepseek": 3, "deepseek_cheap_embed": 2}[case]
        assert ours["n_shared_experts"] == 1 and ours["n_routed_experts"] == routed
        return
    import transformers

    theirs = transformers.AutoConfig.from_pretrained(theirs_dir).to_dict()
    ours = transformers.AutoConfig.from_pretrained(ours_dir).to_dict()
    for doc in (theirs, ours):
        doc.pop("_name_or_path", None)
        doc.pop("transformers_version", None)
    assert ours == theirs


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("deepseek")])
def test_loads_in_transformers_and_generates_mergekits_tokens(outputs: dict[str, tuple[Path, Path]],
                                                              case: str) -> None:
    import transformers

    generated = []
    for directory in outputs[case]:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
        ids = torch.tensor([[1, 5, 9, 12, 30]])
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()
            generated.append(model.generate(ids, max_new_tokens=6, do_sample=False).tolist())
    assert generated[0] == generated[1]


def test_tokenizer_pads_as_mergekits(outputs: dict[str, tuple[Path, Path]]) -> None:
    import transformers

    loaded = [transformers.AutoTokenizer.from_pretrained(d) for d in outputs["mixtral_cheap_embed"]]
    assert loaded[1].pad_token == loaded[0].pad_token == "<s>"
    assert loaded[1]("ab cd Zq")["input_ids"] == loaded[0]("ab cd Zq")["input_ids"]
    ours = outputs["mixtral_cheap_embed"][1]
    assert (ours / "mergekit_moe_config.yml").is_file() and not (ours / "mergekit_config.yml").exists()
