"""Every config mergekit-moe refuses (or crashes on) is refused before any weight is read: a ConfigError (exit 2)
whose one line names the YAML path, and OUT is never created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from resumerge import api
from resumerge.api.flagmap import grouped
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import EXIT_INVALID, InputError, exit_code_for
from resumerge.runs.moe import is_moe_text, load_moe_text
from tests.moe.models import llamas, write
from tests.support import cli


def _expert(model: Path | str, *prompts: str, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"source_model": str(model)}
    if prompts:
        doc["positive_prompts"] = list(prompts)
    return {**doc, **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return llamas(tmp_path_factory.mktemp("refusals"))


def _refused(tmp_path: Path, doc: dict[str, Any], **run: Any) -> InputError:
    out = tmp_path / "out"
    with pytest.raises(InputError) as caught:
        api.run(write(tmp_path / "moe.yml", doc), out, **grouped(api.run, run))
    assert not out.exists()
    assert exit_code_for(caught.value) == EXIT_INVALID
    return caught.value


# (config changes over a valid prompt-gated config, YAML path, words of the message)
YAML_ONLY = [
    ({"gate_mode": "learned"}, "gate_mode", "unknown gate_mode 'learned'"),
    ({"experts_per_token": 0}, "experts_per_token", "Experts per token must be >= 1"),
    ({"experts_per_token": 3}, "experts", "Must include at least as many experts as experts_per_token."),
    ({"merge": "x"}, "merge", "unknown key 'merge'"),
    ({"dtype": "float8"}, "dtype", "unknown dtype"),
    ({"dtype": "int64"}, "dtype", "'int64' is not a float type"),
]


@pytest.mark.parametrize(("change", "where", "words"), YAML_ONLY)
def test_yaml_refusals(models: list[Path], tmp_path: Path, change: dict[str, Any], where: str, words: str) -> None:
    doc = {"base_model": str(models[0]), "gate_mode": "cheap_embed",
           "experts": [_expert(models[1], "a"), _expert(models[2], "b")], **change}
    error = _refused(tmp_path, doc)
    assert error.yaml_path == where and words in error.message


def test_expert_rules(models: list[Path]) -> None:
    def problem(doc: dict[str, Any], **kw: Any) -> tuple[str | None, str]:
        with pytest.raises(InputError) as caught:
            load_moe_text(__import__("yaml").safe_dump(doc), **kw)
        return caught.value.yaml_path, caught.value.message

    m0, m1, m2 = (str(m) for m in models)
    no_prompts = {"base_model": m0, "gate_mode": "uniform_random", "experts": [_expert(m1, "a"), _expert(m2)]}
    assert problem(no_prompts) == ("experts[1].positive_prompts", "Expert 1 has no positive prompts.")
    same_prompts = {"base_model": m0, "gate_mode": "hidden", "experts": [_expert(m1, "a"), _expert(m2, "a")]}
    assert problem(same_prompts)[1].startswith("Your positive and negative prompts are identical for all experts.")
    same_models = {"base_model": m0, "gate_mode": "hidden", "experts": [_expert(m1, "a"), _expert(m1, "b")]}
    assert problem(same_models)[1].startswith("All of your expert models are the same.")
    assert load_moe_text(__import__("yaml").safe_dump(same_models), allow_all_same=True).experts[1].model.path == m1
    mixed = {"base_model": m0, "gate_mode": "random", "experts": [_expert(m1), _expert(m2)],
             "shared_experts": [_expert(m0, "a"), _expert(m1)]}
    assert problem(mixed) == ("shared_experts", "Must specify prompts for all shared experts or none, not a mix")
    unknown = {"base_model": m0, "gate_mode": "random", "experts": [_expert(m1, weight=1), _expert(m2)]}
    assert problem(unknown) == ("experts[0].weight", "unknown key 'weight'")
    # random gates need no prompts, and two different experts are fine
    assert load_moe_text(__import__("yaml").safe_dump({"base_model": m0, "gate_mode": "random",
                                                       "experts": [_expert(m1), _expert(m1)]})).gate_mode == "random"


def test_recognised_like_a_recipe(models: list[Path]) -> None:
    assert is_moe_text(f"base_model: {models[0]}\nexperts:\n  - source_model: {models[1]}\n")
    assert not is_moe_text("merge_method: linear\nexperts: []\n")
    assert not is_moe_text("a: [\n")


def test_header_refusals(models: list[Path], tmp_path: Path) -> None:
    m0, m1, m2 = (str(m) for m in models)
    no_match = _refused(tmp_path, {"base_model": m0, "gate_mode": "random", "architecture": "llama4",
                                   "experts": [_expert(m1), _expert(m2)]})
    assert no_match.yaml_path == "architecture" and "Mixtral, DeepSeek MoE, Qwen MoE, Qwen3 MoE" in no_match.one_line()
    qwen3_only = _refused(tmp_path, {"base_model": m0, "gate_mode": "random", "architecture": "qwen3",
                                     "experts": [_expert(m1), _expert(m2)]})
    assert "No output architecture found that is compatible" in qwen3_only.message
    assert "every model must be qwen3" in qwen3_only.one_line()
    deep = make_model(tmp_path / "deep", ModelSpec(layers=3), seed=9)
    layers = _refused(tmp_path, {"base_model": m0, "gate_mode": "random", "experts": [_expert(m1), _expert(deep)]})
    assert layers.yaml_path == "experts[1].source_model" and "has 3 layers, the base has 2" in layers.message
    qwen = make_model(tmp_path / "qwen", ModelSpec(layers=2, arch="qwen2"), seed=9)
    arch = _refused(tmp_path, {"base_model": m0, "gate_mode": "random", "architecture": "qwen",
                               "experts": [_expert(m1), _expert(qwen)], "shared_experts": [_expert(m0)]})
    assert "same model_type" in arch.one_line()
    stranger = make_model(tmp_path / "stranger", ModelSpec(layers=2), seed=9)
    shared = _refused(tmp_path, {"base_model": m0, "gate_mode": "random",
                                 "experts": [_expert(m1), _expert(m2)], "shared_experts": [_expert(stranger)]})
    assert shared.yaml_path == "shared_experts[0].source_model" and "neither the base" in shared.message


def test_cli_exit_2_one_line(models: list[Path], tmp_path: Path) -> None:
    config = write(tmp_path / "moe.yml", {"base_model": str(models[0]), "gate_mode": "learned",
                                          "experts": [_expert(models[1], "a"), _expert(models[2], "b")]})
    done = cli("run", config, tmp_path / "out")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: gate_mode: unknown gate_mode 'learned'")
    assert not (tmp_path / "out").exists()


def test_the_same_experts_flag_is_an_api_keyword(models: list[Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # mergekit-moe's --i-understand-this-is-not-useful-without-training is api.run's allow_same_experts (the CLI
    # passes it by name): experts that are all one model are refused without it, planned with it, and the flag
    # is refused for a config that is not a mergekit-moe one rather than read as --allow-crimes. (The CLI runs
    # in this process: what is checked is how it maps its flag, not a process start.)
    m0, m1 = (str(m) for m in models[:2])
    same = {"base_model": m0, "gate_mode": "uniform_random", "experts": [_expert(m1, "a"), _expert(m1, "b")]}
    assert _refused(tmp_path, same).message.startswith("All of your expert models are the same.")
    config = write(tmp_path / "same.yml", same)
    assert api.plan_merge(config, settings=api.Settings(merging=api.Merging(allow_same_experts=True))).method == "moe"
    state = str(tmp_path / "state")
    assert main(["run", str(config), str(tmp_path / "out"), "--i-understand-this-is-not-useful-without-training",
                 "--random-seed", "3", "--state-dir", state, "--quiet"]) == 0
    assert (tmp_path / "out" / "mergekit_moe_config.yml").read_text() == config.read_text()
    # the recorded config is planned again, without the flag
    assert main(["resume", str(tmp_path / "out"), "--state-dir", state, "--quiet"]) == 0
    linear = write(tmp_path / "linear.yml", {"merge_method": "linear", "models": [
        {"model": m0, "parameters": {"weight": 1.0}}, {"model": m1, "parameters": {"weight": 1.0}}]})
    capsys.readouterr()
    assert main(["run", str(linear), str(tmp_path / "out2"), "--i-understand-this-is-not-useful-without-training",
                 "--state-dir", state]) == 2
    assert "applies to mergekit-moe configs" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_a_top_level_key_holding_anchors_is_ignored_as_mergekit_moe_ignores_it(models: list[Path]) -> None:
    m0, m1, m2 = (str(m) for m in models)
    text = (f"x-prompts: &prompts [a, b]\nbase_model: {m0}\ngate_mode: cheap_embed\nexperts:\n"
            f"  - {{source_model: {m1}, positive_prompts: *prompts}}\n"
            f"  - {{source_model: {m2}, positive_prompts: [c]}}\n")
    assert load_moe_text(text).experts[0].positive_prompts == ("a", "b")
    with pytest.raises(InputError, match="unknown key 'x-other'"):  # an anchor no alias uses: refused as before
        load_moe_text(text.replace("x-prompts: &prompts [a, b]\n", "x-other: &o [a]\n").replace("*prompts", "[a]"))
