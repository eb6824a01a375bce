"""Issue 69's family table, the rows the other files leave open: every family's linear merge is complete, exact and
loads in transformers (no missing, unexpected or mismatched key); ``check``'s NLL is transformers' unpadded
whole-model NLL (tests/check/test_newest_check.py holds the families of tests/newest_families.py); TIES ranks each
expert of a fused stack apart (Gemma 4's MoE as Granite 4's and Mistral 4's); a stack of slices is renumbered byte
for byte with every per-layer fact; MoE upcycling and a GGUF output are refused in one line, and extract-lora gives
an adapter PEFT loads or refuses in one line. Tiny models of
tests/family_table.py and tests/newest_families.py. The table itself, each cell with the test that proves it: the
families report of issue 69."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from family_table import TABLE, make_table_model
from newest_families import NEWEST
from support import api_merge, output_tensors

from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

ROWS = [*TABLE, "gemma4", "gemma4_shared", "glm5", "deepseek_v32", "nemotron_h", "lfm2", "lfm2_moe"]
# lengths that put padding beside real positions in a batch
_IDS = torch.Generator().manual_seed(0)
TOKENS = [torch.randint(3, 128, (n,), generator=_IDS).tolist() for n in (30, 17, 9)]


def _load(directory: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
        except ValueError:  # Mistral 4: its base model
            return AutoModel.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


@pytest.mark.parametrize("family", ROWS)
def test_a_linear_merge_is_complete_exact_and_loads(family: str, tmp_path: Path) -> None:
    a, b = make_table_model(tmp_path / "a", family, 1), make_table_model(tmp_path / "b", family, 2)
    out = api_merge(tmp_path, {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})
    ta, tb, merged = output_tensors(a), output_tensors(b), output_tensors(out)
    assert set(merged) == set(ta)
    assert not [n for n in ta if not torch.equal(merged[n], 0.5 * ta[n] + 0.5 * tb[n])]
    assert any(not torch.equal(ta[n], tb[n]) for n in ta)
    _, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("family", [f for f in TABLE if f != "mistral4"])
def test_check_nll_is_transformers_unpadded_nll(family: str, tmp_path: Path) -> None:
    from newest_check import checked_nll, unpadded_nll

    model = make_table_model(tmp_path / family, family, 3)
    assert checked_nll(model, TOKENS, tmp_path / "journal") == pytest.approx(unpadded_nll(model, TOKENS), abs=1e-4)


# families whose experts transformers saves fused, one stack of every expert per projection
FUSED = ("gemma4_moe", "granite4", "mistral4")


@pytest.mark.parametrize("family", FUSED)
def test_ties_ranks_each_expert_of_a_fused_stack_apart(family: str, tmp_path: Path) -> None:
    # One expert of B changed in every stack moves that expert of the merge only: TIES ranks each expert apart
    # (tests/test_module_experts.py checks Granite 4's and Mistral 4's against each expert merged alone).
    from safetensors.torch import load_file, save_file

    a, b = make_table_model(tmp_path / "a", family, 1), make_table_model(tmp_path / "b", family, 2)
    (shard,) = b.glob("*.safetensors")
    experts = int(TABLE[family][1].get("num_experts") or TABLE[family][1].get("num_local_experts")
                  or TABLE[family][1]["n_routed_experts"])
    tensors = load_file(str(shard))
    stacks = [n for n, t in tensors.items() if t.dim() == 3 and t.shape[0] == experts]
    assert stacks
    nudged = tmp_path / "b2"
    nudged.mkdir()
    for f in b.iterdir():
        if f.name != shard.name:
            (nudged / f.name).write_bytes(f.read_bytes())
    for n in stacks:
        tensors[n] = tensors[n].clone()
        tensors[n][0] += 0.5
    save_file(tensors, str(nudged / shard.name), metadata={"format": "pt"})

    def ties(other: Path, where: Path) -> dict[str, Any]:
        return output_tensors(api_merge(where, {"merge_method": "ties", "base_model": str(a), "dtype": "float32",
                                                "parameters": {"density": 0.5, "weight": 1.0}, "models": [
                                                    {"model": str(other)}, {"model": str(b)}]}))

    one, two = ties(b, tmp_path / "m1"), ties(nudged, tmp_path / "m2")
    for n in stacks:
        assert not torch.equal(one[n][0], two[n][0]), n
        assert torch.equal(one[n][1:], two[n][1:]), n


STACK = (0, 1, 1)  # slices a[0, 2) + a[1, 2): every two-layer pattern of the table changes


def _layer_lists(config: Any, count: int) -> dict[str, list[Any]]:
    """The lists of transformers' built ``config`` with one entry per layer (as its modeling code reads them)."""
    return {k: v for k, v in vars(config).items() if isinstance(v, list) and len(v) == count and k != "architectures"}


@pytest.mark.parametrize("family", [*TABLE, "kimi_linear-numbered", "deepseek_v32", "lfm2"])
def test_a_stack_of_slices_is_renumbered_byte_equal_with_every_per_layer_fact(family: str, tmp_path: Path) -> None:
    import json
    import re

    from transformers import AutoConfig

    source = make_table_model(tmp_path / "a", family.split("-")[0], 1)
    if family == "kimi_linear-numbered":  # as Kimi-Linear's hub config.json: the layers' kinds by number only
        doc = json.loads((source / "config.json").read_text())
        del doc["layer_types"], doc["mlp_layer_types"]
        (source / "config.json").write_text(json.dumps(doc))
    out = api_merge(tmp_path, {"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(source), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(source), "layer_range": [1, 2]}]}]})
    theirs, ours = output_tensors(source), output_tensors(out)
    layer = re.compile(r"^(.*?layers\.)(\d+)(\..*)$")
    renamed = {}
    for name in ours:
        found = layer.match(name)
        renamed[name] = name if found is None else f"{found[1]}{STACK[int(found[2])]}{found[3]}"
    kept = {n for n in theirs if (found := layer.match(n)) is None or int(found[2]) in STACK}
    assert set(renamed.values()) == kept
    assert all(torch.equal(ours[n], theirs[renamed[n]]) for n in ours)
    before, after = AutoConfig.from_pretrained(source), AutoConfig.from_pretrained(out)
    assert after.num_hidden_layers == len(STACK)
    lists = _layer_lists(before, before.num_hidden_layers)
    assert _layer_lists(after, len(STACK)) == {k: [v[i] for i in STACK] for k, v in lists.items()}
    if family.startswith("kimi_linear"):  # the numbers vLLM and Kimi's own code read, from 1
        written = json.loads((out / "config.json").read_text())["linear_attn_config"]
        assert (written["kda_layers"], written["full_attn_layers"]) == ([1], [2, 3])
    _, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def _one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``resumerge ARGS`` refuses with (exit 2, no traceback)."""
    from resumerge.cli.commands import main

    capsys.readouterr()
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("family", ROWS)
def test_moe_upcycling_and_a_gguf_output_are_refused_in_one_line(family: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    model = make_table_model(tmp_path / "a", family, 1)
    model_type = (TABLE[family] if family in TABLE else NEWEST[family])[0]
    linear = tmp_path / "linear.yml"
    linear.write_text(yaml.safe_dump({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(model), "parameters": {"weight": 1.0}}]}))
    line = _one_line(["plan", str(linear), "--out-type", "gguf"], capsys)
    assert f"a GGUF output of a {model_type} model, which resumerge cannot write yet" in line
    moe = tmp_path / "moe.yml"
    moe.write_text(yaml.safe_dump({"base_model": str(model), "gate_mode": "random", "dtype": "float32",
                                   "experts": [{"source_model": str(model)}, {"source_model": str(model)}]}))
    line = _one_line(["plan", str(moe)], capsys)
    assert "No output architecture found" in line and f"(got {model_type})" in line


# families whose extract-lora adapter PEFT loads as it is; the others name, in one line, a module PEFT could not
# wrap and the -e that leaves it out (tests/extract/test_family_modules.py and test_peft_families.py: the newest)
ADAPTED = ("qwen3_5", "gemma4_moe", "olmo3", "smollm3")


@pytest.mark.parametrize("family", [*sorted(TABLE), "deepseek_v32"])
def test_extract_lora_gives_an_adapter_peft_loads_or_refuses_in_one_line(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, ft = make_table_model(tmp_path / "base", family, 1), make_table_model(tmp_path / "ft", family, 2)
    out = tmp_path / "lora"
    args = ["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out), "--quiet"]
    if family not in ADAPTED:
        line = _one_line(args, capsys)
        assert "cannot be given LoRA factors PEFT loads" in line and " -e " in line, line
        assert not out.exists()
        return
    from peft import PeftModel

    from resumerge.cli.commands import main

    assert main(args) == 0
    fine, _ = _load(ft)
    with warnings.catch_warnings():  # PEFT's on a tied head, transformers' deprecations
        warnings.simplefilter("ignore")
        adapted = PeftModel.from_pretrained(_load(base)[0], str(out))
    ids = torch.arange(3, 128, 7).reshape(1, -1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = fine(input_ids=ids).logits, adapted(input_ids=ids).logits
        assert (want - _load(base)[0](input_ids=ids).logits).abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_check_of_mistral4_without_a_head_is_refused_in_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # transformers 5.24 has no causal-LM class of Mistral 4's own: its checkpoint is a base model, without lm_head
    from resumerge.cli.modelgen import write_tokenizer

    model = make_table_model(tmp_path / "mistral4", "mistral4", 3)
    write_tokenizer(model, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    line = _one_line(["check", str(model), "--prompts", str(texts), "--state-dir", str(tmp_path / "s"), "--quiet"],
                     capsys)
    assert "has lm_head.weight, which neither the checkpoint nor transformers' conversion of it gives" in line
