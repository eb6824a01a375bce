"""``core_space`` end to end: LoRA adapters of one base merged through their factors by the CLI, kill+resume, and
the one-line refusals of parents it cannot merge."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora.gen import make_adapter, make_gpt2, peft_merged
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import cli, digests, output_tensors

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fp32 llama and three adapters of it: plain r=4, rsLoRA r=2, plain r=3 with alpha ≠ r."""
    root = tmp_path_factory.mktemp("core")
    base = make_model(root / "base", ModelSpec(), seed=7)
    make_adapter(base, root / "a1", r=4, alpha=8, targets=TARGETS, seed=1)
    make_adapter(base, root / "a2", r=2, alpha=4, rslora=True, targets=TARGETS, seed=2)
    make_adapter(base, root / "a3", r=3, alpha=5, targets=TARGETS, seed=3)
    return root


def _config(root: Path, inner: str, adapters: tuple[str, ...] = ("a1", "a2", "a3"), extra: str = "") -> Path:
    lines = [f"merge_method: core_space\nbase_model: {root / 'base'}\nmodels:"]
    lines += [f"  - model: {root / 'base'}+{root / a}" for a in adapters]
    lines += [f"parameters:\n  inner: {inner}\n  scaling: 0.7\n  density: 0.5", extra]
    path = root / f"{inner}-{'-'.join(adapters)}.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _summed(root: Path, adapters: tuple[str, ...], alpha: float) -> dict[str, torch.Tensor]:
    """W₀ + α·Σ sᵢBᵢAᵢ in float64, from the adapter files and PEFT's scaling rule."""
    merged = {k: v.double() for k, v in output_tensors(root / "base").items()}
    for name in adapters:
        config = json.loads((root / name / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / (math.sqrt(config["r"]) if config["use_rslora"] else config["r"])
        factors = load_file(str(root / name / "adapter_model.safetensors"))
        for key, a in factors.items():
            if ".lora_A." in key:
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = factors[key.replace(".lora_A.", ".lora_B.")]
                merged[f"{module}.weight"] += alpha * scale * (b.double() @ a.double())
    return merged


def test_task_arithmetic_adds_every_adapters_scaled_product(tmp_path: Path, family: Path) -> None:
    out = tmp_path / "out"
    assert main(["run", str(_config(family, "task_arithmetic")), str(out), "--quiet"]) == 0
    merged, want = output_tensors(out), _summed(family, ("a1", "a2", "a3"), 0.7)
    base = output_tensors(family / "base")
    changed = 0
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor.double(), want[key], rtol=0, atol=2e-6, msg=key)
        changed += not torch.equal(tensor, base[key])
    adapted = sum(".lora_A." in k for k in load_file(str(family / "a1" / "adapter_model.safetensors")))
    assert changed == adapted > 0  # every targeted module, nothing else
    assert "arxiv.org/abs/2509.17786" in (out / "README.md").read_text()


@pytest.mark.parametrize(("inner", "flags"), [("ties", ()), ("tsv", ()), ("tsv", ("--out-adapter",))])
def test_killed_and_resumed_is_identical(tmp_path: Path, family: Path, inner: str, flags: tuple[str, ...]) -> None:
    config = _config(family, inner)
    ref = tmp_path / "ref"
    assert main(["run", str(config), str(ref), "--out-shard-size", "200k", *flags, "--quiet"]) == 0
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--out-shard-size", "200k", *flags, "--state-dir", state, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == digests(ref)


def _pair(tmp_path: Path, family: Path, second: str) -> Path:
    """A core_space config over the base's first adapter and ``second``."""
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: core_space\nbase_model: {family / 'base'}\nmodels:\n"
                      f"  - model: {family / 'base'}+{family / 'a1'}\n  - model: {second}\n")
    return config


def _refused(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    capsys.readouterr()
    assert main(["run", str(config), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_a_parent_that_is_no_adapter_is_refused(tmp_path: Path, family: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    if not (family / "other").exists():
        make_model(family / "other", ModelSpec(), seed=8)
    config = _pair(tmp_path, family, str(family / "other"))
    _refused(config, tmp_path, capsys, "not a base+adapter reference", "models[1]")


def test_an_adapter_of_another_base_is_refused(tmp_path: Path, family: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    other = family / "other"
    if not other.exists():
        make_model(other, ModelSpec(), seed=8)
    config = _pair(tmp_path, family, f"{other}+{family / 'a2'}")
    _refused(config, tmp_path, capsys, "applies its adapter to", "models[1]")


def test_adapters_of_different_modules_are_refused(tmp_path: Path, family: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    make_adapter(family / "base", tmp_path / "qk", r=2, alpha=2, targets=["q_proj", "k_proj"], seed=5)
    config = _pair(tmp_path, family, f"{family / 'base'}+{tmp_path / 'qk'}")
    _refused(config, tmp_path, capsys, "differ on", "target_modules")


def test_a_dora_adapter_is_refused(tmp_path: Path, family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_adapter(family / "base", tmp_path / "dora", r=2, alpha=2, targets=TARGETS, seed=6, use_dora=True)
    config = _pair(tmp_path, family, f"{family / 'base'}+{tmp_path / 'dora'}")
    _refused(config, tmp_path, capsys, "DoRA")


def test_an_unknown_inner_method_is_refused(tmp_path: Path, family: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _refused(_config(family, "dare"), tmp_path, capsys, "inner must be one of")


def test_plan_times_the_factor_merge(tmp_path: Path, family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The plan's timing call makes synthetic inputs of each input's shape: the factors are no fine-tunes of the
    # base's shape, and once made as such the call failed and the plan said "not measured".
    capsys.readouterr()
    assert main(["plan", str(_config(family, "tsv")), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "SVD-bound (2 SVDs of the stacked factors" in said
    assert "not measured" not in said


@pytest.mark.parametrize("inner", ["task_arithmetic", "ties", "tsv"])
def test_the_merged_adapter_applied_by_peft_is_the_merged_model(tmp_path: Path, family: Path, inner: str) -> None:
    config = _config(family, inner)
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    assert main(["run", str(config), str(model), "--quiet"]) == 0
    assert main(["run", str(config), str(adapter), "--out-adapter", "--quiet"]) == 0
    assert not (adapter / "config.json").exists()
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == settings["lora_alpha"] == 4 + 2 + 3  # the summed ranks (each module's n is larger)
    merged = output_tensors(model)
    by_peft = peft_merged(family / "base", adapter)
    assert set(merged) <= set(by_peft)
    for key, tensor in merged.items():
        torch.testing.assert_close(by_peft[key], tensor, rtol=0, atol=2e-6, msg=key)


def test_out_adapter_needs_a_factor_merge(tmp_path: Path, family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {family / 'base'}+{family / 'a1'}\n"
                      "    parameters: {weight: 1.0}\n")
    capsys.readouterr()
    assert main(["run", str(config), str(tmp_path / "out"), "--out-adapter"]) == 2
    assert "--out-adapter writes a merge of LoRA adapters, which linear is not" in capsys.readouterr().err


def test_tensors_an_adapter_saves_whole_stay_the_base_and_plan_says_so(
        tmp_path: Path, family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_adapter(family / "base", tmp_path / "head", r=2, alpha=2, targets=TARGETS, seed=7,
                 modules_to_save=["lm_head"])
    config = _pair(tmp_path, family, f"{family / 'base'}+{tmp_path / 'head'}")
    capsys.readouterr()
    assert main(["plan", str(config), str(tmp_path / "out")]) == 0
    assert "also saves 1 tensor(s) whole (e.g. lm_head.weight)" in capsys.readouterr().out
    assert main(["run", str(config), str(tmp_path / "out"), "--quiet"]) == 0
    merged, base = output_tensors(tmp_path / "out"), output_tensors(family / "base")
    assert torch.equal(merged["lm_head.weight"], base["lm_head.weight"])


@pytest.mark.parametrize("kind", ["llama-embedding", "gpt2-conv1d", "llama-bf16-rslora"])
def test_every_layer_kind_merges_as_peft_applies_it(tmp_path: Path, family: Path, kind: str) -> None:
    # Embedding LoRA is stored (r × vocab, dim × r) and applied transposed, GPT-2's Conv1D layers (fan_in_fan_out)
    # too; a bf16 base meets float32 factors. Oracle: the sum of what PEFT applies for each adapter alone.
    base_dir = family / "base"
    targets, rslora = ["q_proj", "embed_tokens"], False
    if kind == "gpt2-conv1d":
        base_dir, targets = make_gpt2(tmp_path / "gpt2"), ["c_attn", "c_proj"]
    elif kind == "llama-bf16-rslora":
        base_dir, targets = make_model(tmp_path / "bf16", ModelSpec(dtype=torch.bfloat16), seed=3), TARGETS
        rslora = True
    for i in (1, 2):
        make_adapter(base_dir, tmp_path / f"e{i}", r=2 * i, alpha=4, targets=targets, seed=10 + i, rslora=rslora)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: core_space\nbase_model: {base_dir}\nmodels:\n"
                      + "".join(f"  - model: {base_dir}+{tmp_path / f'e{i}'}\n" for i in (1, 2)))
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    assert main(["run", str(config), str(model), "--quiet"]) == 0
    assert main(["run", str(config), str(adapter), "--out-adapter", "--quiet"]) == 0
    transposed = json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"]
    assert transposed is (kind == "gpt2-conv1d")
    base = {k: v.double() for k, v in output_tensors(base_dir).items()}
    each = [{k: v.double() for k, v in peft_merged(base_dir, tmp_path / f"e{i}").items()} for i in (1, 2)]
    by_peft = peft_merged(base_dir, adapter)
    merged = output_tensors(model)
    # bf16: every PEFT result is rounded to the weight's dtype, the summed oracle thrice (2⁻⁸ of the weight's size
    # each); the merged adapter applied by PEFT and the merged model round once each.
    half = kind == "llama-bf16-rslora"
    changed = 0
    for key, tensor in merged.items():
        summed = base[key] + (each[0][key] - base[key]) + (each[1][key] - base[key])
        atol = 3 * 2**-8 * float(summed.abs().max()) if half else 2e-6
        torch.testing.assert_close(tensor.double(), summed, rtol=0, atol=atol, msg=key)
        torch.testing.assert_close(by_peft[key].double(), tensor.double(), rtol=8e-3 if half else 0, atol=atol,
                                   msg=key)
        changed += not torch.equal(tensor.double(), base[key])
    assert changed >= 4


def test_the_base_may_be_written_another_way(tmp_path: Path, family: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(family)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: core_space\nbase_model: {family / 'base'}\nmodels:\n"
                      f"  - model: ./base+{family / 'a1'}\n  - model: base+{family / 'a2'}\n")
    assert main(["run", str(config), str(tmp_path / "out"), "--quiet"]) == 0
    assert any((tmp_path / "out").glob("*.safetensors"))
