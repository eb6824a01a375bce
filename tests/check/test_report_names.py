"""A check's report reads at 80 columns and its card names only what is the merge's (issue 70, item 7): each model
by a short name that tells it from the others (the full paths listed once), a model the merge's record does not
name listed as "also compared with", and no local absolute path in the card people publish."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from resumerge import api
from resumerge.analyses.check.card import BEGIN, END, render_section
from resumerge.analyses.check.names import short_names
from resumerge.analyses.check.report import CheckReport, ModelFigures, StaticFigures
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.cli.render import show_check

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
ROOT = "/home/someone/experiments/2026-11-26/merges-of-smollm2-135m-instruct"


def _report(paths: list[str], own: tuple[bool, ...] | None = None) -> CheckReport:
    roles = ["merge", "base"] + ["parent"] * (len(paths) - 2)
    models = tuple(ModelFigures(role, path, nll=2.5 + i, kl=None if i == 0 else 0.1 * i, top1=None if i == 0 else 0.9,
                                drift=() if i == 0 else (0.1, 0.2), **({"own": own[i]} if own else {}))
                   for i, (role, path) in enumerate(zip(roles, paths)))
    return CheckReport(verdict="works", reasons=(f"closest to the parent {paths[2]} (KL 0.2 nats/token)",),
                       broken_layer=None, models=models, static=StaticFigures({}, (), (), (), ()), sequences=2,
                       tokens=20, thresholds={"nll_factor": 1.5}, compared="the merge with its base and 2 parent(s)")


def test_short_names_tell_the_models_apart() -> None:
    assert short_names(["/a/b/merged", "/a/c/merged", "/x/base", "hf://org/name@main", "/x/base"]) == [
        "b/merged", "c/merged", "base", "hf://org/name@main", "base"]


def test_the_report_reads_at_80_columns_each_model_by_a_name_of_its_own() -> None:
    paths = [f"{ROOT}/{name}" for name in ("out-linear", "base", "parent-chat", "parent-code")]
    stream = io.StringIO()
    show_check(_report(paths), stream, width=80)
    text = stream.getvalue()
    table = text.split("\n  base:")[0]
    assert all(len(line) <= 80 for line in table.splitlines()), table
    for role, name in zip(("merge", "base", "parent", "parent"), ("out-linear", "base", "parent-chat",
                                                                    "parent-code")):
        assert any(line.split()[:2] == [role, name] for line in table.splitlines()), table
    for path, name in zip(paths[1:], ("base", "parent-chat", "parent-code")):
        assert text.count(path) == 1 and f"  {name}: {path}" in text  # each full path once
    assert paths[0] not in text  # the merge is MODEL as the command gave it: the legend does not repeat it
    assert "closest to the parent parent-chat (KL" in text


def test_long_names_and_headers_are_never_cut_at_80_columns() -> None:
    # issue 87: at 80 columns two parents were "a-rather-lo…" and "a-rather-lo…", the KL header "KL(this‖mer…"
    names = ("the-merged-output-of-a-long-name", "a-rather-long-base-model-name", "a-rather-long-parent-number-0",
             "a-rather-long-parent-number-1")
    paths = [f"{ROOT}/{name}" for name in names]
    stream = io.StringIO()
    show_check(_report(paths), stream, width=80)
    text = stream.getvalue()
    assert "…" not in text and "KL(this‖merge)" in text, text
    table = text.split("\n  a-rather-long-base-model-name:")[0]
    for role, name in zip(("merge", "base", "parent", "parent"), names):
        assert any(line.split()[:2] == [role, name] for line in table.splitlines()), table


def test_the_card_names_only_the_merges_own_base_and_parents_and_no_local_path(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    parents = [make_model(tmp_path / f"p{i}", SPEC, seed=i) for i in range(2)]
    other = make_model(tmp_path / "not-a-parent", SPEC, seed=5)
    config = tmp_path / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    out, state = tmp_path / "out", tmp_path / "state"
    api.run(config, out, settings=api.Settings(state_dir=state))
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    report = api.check(out, parents=[*parents, other], prompts=texts, settings=api.Settings(state_dir=state))
    assert [m.own for m in report.models] == [True, True, True, False]
    card = (out / "README.md").read_text()
    section = card[card.index(BEGIN):card.index(END)]
    assert "| parent | p0 |" in section and "| parent | p1 |" in section and "| parent | not-a-parent" not in section
    assert "- Also compared with: not-a-parent (NLL " in section
    assert str(tmp_path) not in section  # no local absolute path in what people publish
    assert section == render_section(report)[:len(section)]
