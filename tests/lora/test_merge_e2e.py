"""``model+adapter`` merges end to end: PEFT parity through the CLI, the adapter's tokenizer, chunks, resume.

Only runs that must be killed start a process; the others run the CLI's ``main`` in this one (the same code without
a Python and torch start-up)."""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lora.conftest import Case
from lora.gen import make_adapter
from resumerge.cli.commands import main
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.workunits import chunk_plan
from tests.support import cli, digests, output_tensors


def _passthrough(path: Path, case: Case) -> Path:
    path.write_text(f"merge_method: passthrough\nmodels:\n  - model: {case.base}+{case.adapter}\n")
    return path


@pytest.mark.parametrize("name", ["llama-f32", "llama-bf16-rslora", "gpt2-f32-bias"])
def test_merged_weights_equal_peft_merge_and_unload(tmp_path: Path, lora_case: Callable[[str], Case],
                                                    name: str) -> None:
    case = lora_case(name)
    out = tmp_path / "out"
    assert main(["run", str(_passthrough(tmp_path / "c.yml", case)), str(out), "--quiet"]) == 0
    merged = output_tensors(out)
    base = output_tensors(case.base)
    # Tied heads are not written (the output is tied too); everything else is there.
    assert set(case.oracle) - set(merged) <= {"lm_head.weight"}
    changed = 0
    for key, tensor in merged.items():
        want = case.oracle[key]
        assert tensor.dtype == want.dtype, key
        torch.testing.assert_close(tensor, want, rtol=0, atol=1e-5, msg=key)
        changed += not torch.equal(tensor, base[key])
    assert changed >= 8  # the adapter really changed the targeted tensors


def test_the_adapters_tokenizer_and_chat_template_reach_the_output(tmp_path: Path,
                                                                   lora_case: Callable[[str], Case]) -> None:
    """mergekit's defect 5: a LoRA merge must not fall back to the base's tokenizer."""
    case = lora_case("llama-f16")
    adapter = tmp_path / "adapter-with-tokenizer"
    template = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}{% endfor %}"
    make_adapter(case.base, adapter, r=2, alpha=4, targets=["q_proj"], tokenizer_from=case.base,
                 chat_template=template)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: passthrough\nmodels:\n  - model: {case.base}+{adapter}\n")
    out = tmp_path / "out"
    assert main(["run", str(config), str(out), "--quiet"]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    assert json.loads((case.base / "tokenizer_config.json").read_text()).get("chat_template") != template
    assert main(["verify", str(out)]) == 0


@pytest.mark.parametrize("name", ["llama-f32", "gpt2-f32-bias"])
def test_row_chunks_give_the_same_bytes_as_the_whole_tensor(tmp_path: Path, lora_case: Callable[[str], Case],
                                                            name: str) -> None:
    """The engine streams big tensors in row chunks; each chunk's LoRA rows must come out bit-identical."""
    case = lora_case(name)
    plan = plan_from_config(load_config_text(_passthrough(tmp_path / "c.yml", case).read_text()), PlanOptions())
    targeted = [tp for tp in plan.tensors.values() if any(i.lora is not None for i in tp.inputs)]
    assert targeted
    reader = InputSources.local(plan.model_dirs)
    try:
        for tp in targeted:
            whole = compute_tensor(plan, tp, reader, NO_RESOURCES)[tp.name]
            rows = tp.shape[0]
            cuts = [0, 1, rows // 3, rows // 3 + 5, rows]
            parts = [compute_tensor(plan, chunk_plan(tp, lo, hi), reader, NO_RESOURCES)[tp.name]
                     for lo, hi in itertools.pairwise(cuts) if hi > lo]
            assert torch.equal(torch.cat(parts), whole), tp.name
    finally:
        reader.close()


def test_lora_merge_killed_and_resumed_is_identical(tmp_path: Path, lora_case: Callable[[str], Case]) -> None:
    case = lora_case("llama-f32")
    config = tmp_path / "c.yml"
    config.write_text(
        "merge_method: linear\nmodels:\n"
        f"  - model: {case.base}+{case.adapter}\n    parameters: {{weight: 0.6}}\n"
        f"  - model: {case.base}\n    parameters: {{weight: 0.4}}\n"
    )
    ref = tmp_path / "ref"
    assert main(["run", str(config), str(ref), "--out-shard-size", "200k", "--quiet"]) == 0
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--out-shard-size", "200k", "--state-dir", state, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert killed.returncode == -signal.SIGKILL
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == digests(ref)


def test_a_changed_adapter_is_refused_on_resume(tmp_path: Path, lora_case: Callable[[str], Case],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    case = lora_case("llama-f16")
    adapter = tmp_path / "adapter"
    make_adapter(case.base, adapter, r=2, alpha=4, targets=["q_proj", "v_proj"], seed=9)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: passthrough\nmodels:\n  - model: {case.base}+{adapter}\n")
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--out-shard-size", "100k", "--state-dir", state, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:1"})
    assert killed.returncode == -signal.SIGKILL
    make_adapter(case.base, adapter, r=2, alpha=4, targets=["q_proj", "v_proj"], seed=10)
    capsys.readouterr()
    assert main(["resume", str(out), "--state-dir", str(state)]) == 4
    assert "adapter_model.safetensors" in capsys.readouterr().err
