"""Texts longer than the models' context (issue 70): one rule for ``check`` and ``measure``
(:func:`resumerge.forward.text.texts.bounded`): a text past the context is refused in one line naming its line and
the limit (exit 2, before any layer runs or anything is written), or cut to the context with ``--truncate-texts``. A
1 MB line held ``measure`` in one layer's attention for minutes, past Ctrl-C; now a SIGINT finds it answered.

Tiny generated models (two layers, width 32, a byte-level tokenizer, a context of 128 positions)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from support import cli_start, write_config

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)  # max_position_embeddings 128
LONG = " ".join(["hello world"] * 100)  # 200 words: more tokens than the 128 positions


def _models(root: Path) -> tuple[Path, Path, Path]:
    return make_model(root / "merge", SPEC, seed=0), make_model(root / "base", SPEC, seed=1), \
        make_model(root / "parent", SPEC, seed=2)


def test_check_refuses_a_text_past_the_context_naming_its_line_and_cuts_it_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    merge, base, parent = _models(tmp_path)
    texts = tmp_path / "texts.txt"
    texts.write_text(f"the cat sat on the mat\n\n{LONG}\n")
    state = tmp_path / "state"
    argv = ["check", str(merge), "--base", str(base), "--parent", str(parent), "--prompts", str(texts),
            "--state-dir", str(state)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"line 3 of --prompts {texts}" in err and "past the 128" in err and "max_position_embeddings" in err, err
    assert "--truncate-texts" in err and len(err.strip().splitlines()) <= 2, err
    assert not [p for p in state.rglob("*.safetensors")]  # no layer ran
    assert main([*argv, "--truncate-texts"]) in (0, 5, 6)
    report = api.check(merge, base=base, parents=[parent], prompts=texts,
                       settings=api.Settings(state_dir=state), truncate_texts=True)
    assert report.sequences == 2 and 127 < report.tokens < 127 + len("the cat sat on the mat")  # the long one cut


def _measure_config(root: Path) -> Path:
    a, b = make_model(root / "a", SPEC, seed=1), make_model(root / "b", SPEC, seed=2)
    return write_config(root / "rm.yml", {
        "merge_method": "regmean", "models": [{"model": str(a)}, {"model": str(b)}],
        "parameters": {"grams": str(root / "grams")}, "dtype": "float32"})


def test_measure_refuses_a_text_past_the_context_before_writing_and_cuts_it_when_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _measure_config(tmp_path)
    texts = tmp_path / "texts.txt"
    texts.write_text(f"{LONG}\nthe cat sat\n")
    out = tmp_path / "grams"
    assert main(["measure", str(config), str(out), "--texts", str(texts), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"line 1 of --texts {texts}" in err and "past the 128" in err, err
    assert not out.exists() or not any(out.iterdir())
    assert main(["measure", str(config), str(out), "--texts", str(texts), "-q", "--truncate-texts"]) == 0
    report = api.measure(config, out, texts=texts, truncate_texts=True)
    assert report.reused and 128 < report.tokens <= 128 + len("the cat sat")  # the long one cut to 128


def test_a_megabyte_line_is_refused_before_any_layer_rather_than_run_past_ctrl_c(tmp_path: Path) -> None:
    # Before: measure ran the 1 MB line through a layer's attention for minutes and a SIGINT went unheard.
    config = _measure_config(tmp_path)
    texts = tmp_path / "texts.txt"
    texts.write_text(" ".join(["hello world"] * 90_000) + "\n")  # about 1 MB
    process = cli_start("measure", config, tmp_path / "grams", "--texts", texts, capture=True)
    try:
        _, err = process.communicate(timeout=120)  # tokenizing the line is most of it: a few seconds
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail("measure of a 1 MB line ran for 2 minutes and then ignored SIGINT for 10 s")
        pytest.fail("measure of a 1 MB line ran for 2 minutes")
    assert process.returncode == 2, err
    assert f"line 1 of --texts {texts}" in err and "past the 128" in err, err
