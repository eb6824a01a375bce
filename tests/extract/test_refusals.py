"""Bad input is refused with exit 2 before any weight is read (OUT is never created)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import ResumergeError, exit_code_for


def _refused(out: Path, call: Callable[[], object], words: str) -> None:
    with pytest.raises(ResumergeError) as caught:
        call()
    assert exit_code_for(caught.value) == 2
    assert words in caught.value.one_line()
    assert not out.exists()


@pytest.mark.parametrize(("lora", "words"), [
    (api.Lora(max_rank=0), "--max-rank must be at least 1"),
    (api.Lora(include_regexes=["q_porj"]), "matches no module"),
    (api.Lora(exclude_regexes=["nope"]), "matches no module"),
    (api.Lora(save_modules=["lm_haed"]), "names no module"),
], ids=["rank below one", "include regex matching nothing", "exclude regex matching nothing",
        "save module that does not exist"])
def test_lora_options_that_cannot_be_met(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]], lora: api.Lora,
                                         words: str) -> None:
    base, ft = pair("llama")
    out = tmp_path / "out"
    _refused(out, lambda: api.extract_lora(str(ft), str(base), out, lora=lora), words)


def test_shapes_that_differ(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    base, _ = pair("llama")
    other = make_model(tmp_path / "wider", ModelSpec(layers=2, hidden=32, intermediate=40, vocab=64), seed=1)
    out = tmp_path / "out"
    _refused(out, lambda: api.extract_lora(str(other), str(base), out), "in the fine-tuned model and")


def test_cli_exit_code(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]], capsys: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    # In process: the CLI's exit code and message are what main() returns and prints (a subprocess only adds
    # interpreter start-up, which the resume tests' subprocesses cover). The test process keeps its signal handlers.
    from resumerge.cli import commands

    monkeypatch.setattr(commands, "installed_stop_flag", lambda: (lambda: False))
    base, ft = pair("llama")
    code = main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(tmp_path / "out"),
                 "--max-rank", "0"])
    assert code == 2
    assert "--max-rank must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_estimates_without_writing(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``extract-lora --plan`` validates and estimates the adapter's exact size, writing nothing; the truncations
    are timed by whole calls (a sample of rows is no smaller truncation, and the first attempt failed on one), and
    a module's weights are counted as read once (its B reads nothing)."""
    import json

    base, ft = pair("llama")
    out = tmp_path / "out"
    code = main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "4", "--plan", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["method"] == "extract_lora" and doc["fits"]
    assert not out.exists()
    factors = [g for g in doc["time"]["compute"] if g["method"].startswith(("lora_extract_a", "lora_extract_b"))]
    assert factors and all(g["whole"] and g["seconds_per_call"] > 0 for g in factors), factors
    weights = sum(f.stat().st_size for d in (base, ft) for f in d.glob("*.safetensors"))
    assert 0 < doc["time"]["read_bytes"] <= weights
    api.extract_lora(str(ft), str(base), out, lora=api.Lora(max_rank=4))
    assert doc["output_bytes"] == (out / "adapter_model.safetensors").stat().st_size


def test_estimate_extraction_is_extract_lora_plan(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    """``estimate_extraction`` is ``extract_lora(plan=True)``'s own function: the same estimate, always one, and
    nothing written."""
    from resumerge.analyses.estimate.costs import Estimate

    base, ft = pair("llama")
    out = tmp_path / "out"
    own = api.estimate_extraction(str(ft), str(base), out, lora=api.Lora(max_rank=4))
    planned = api.extract_lora(str(ft), str(base), out, plan=True, lora=api.Lora(max_rank=4))
    assert isinstance(own, Estimate) and isinstance(planned, Estimate)
    assert own.plan.fingerprint == planned.plan.fingerprint
    assert own.output.total_bytes == planned.output.total_bytes
    assert not out.exists()
def test_errors_name_the_flags_not_yaml_paths(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    # The user wrote no YAML: an unusable model is named by the flag that gave it.
    base, ft = pair("llama")
    out, missing = tmp_path / "out", tmp_path / "missing"
    for model, base_model, flag in ((missing, base, "--model: "), (ft, missing, "--base-model: ")):
        with pytest.raises(ResumergeError) as caught:
            api.extract_lora(str(model), str(base_model), out)
        assert caught.value.one_line().startswith(flag), caught.value.one_line()
        assert "models[" not in caught.value.one_line() and "base_model" not in caught.value.one_line()
