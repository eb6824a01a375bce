"""The card's section is written only through the run's own ledger (issue 70, item 4): a check with a state dir of
its own finds the run's ledger where a command given no ``--state-dir`` finds it, or leaves the card alone and says
so; ``verify`` then never calls damaged what resumerge wrote, and a ``resume`` keeps the section.

Tiny generated models (two layers, width 32): each check is a second or two."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from resumerge import api
from resumerge.analyses.check.card import BEGIN
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import RunLocations
from resumerge.merge.store.manifest import manifest_path

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)


def _merged(root: Path, state: Path | None) -> tuple[Path, list[Path]]:
    parents = [make_model(root / f"p{i}", SPEC, seed=i) for i in range(2)]
    config = root / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    out = root / "out"
    api.run(config, out, settings=api.Settings(state_dir=state))
    return out, parents


def test_a_check_in_its_own_state_dir_leaves_the_card_of_a_run_recorded_elsewhere(tmp_path: Path) -> None:
    out, _ = _merged(tmp_path, tmp_path / "runs")
    card, manifest = (out / "README.md").read_bytes(), manifest_path(out).read_bytes()
    report = api.check(out, settings=api.Settings(state_dir=tmp_path / "checks"))
    assert (out / "README.md").read_bytes() == card and manifest_path(out).read_bytes() == manifest
    assert report.card is not None and "left as it is, without the check's section" in report.card
    assert "--state-dir" in report.card
    verified = api.verify(out, settings=api.Settings(state_dir=tmp_path / "runs"))
    assert verified.ok, verified.damaged
    # Checked with the run's own state dir, the section is written and recorded there.
    report = api.check(out, settings=api.Settings(state_dir=tmp_path / "runs"))
    assert report.card is not None and "section written" in report.card
    assert api.verify(out, settings=api.Settings(state_dir=tmp_path / "runs")).ok


def test_a_check_in_its_own_state_dir_finds_the_ledger_of_the_default_one(tmp_path: Path) -> None:
    out, _ = _merged(tmp_path, None)  # the default state dir (the suite's RESUMERGE_STATE_DIR)
    report = api.check(out, settings=api.Settings(state_dir=tmp_path / "checks"))
    data = (out / "README.md").read_bytes()
    assert BEGIN.encode() in data and report.card is not None and "section written" in report.card
    verified = api.verify(out)
    assert verified.ok, verified.damaged
    with sqlite3.connect(RunLocations.of(out, None).ledger) as db:  # the run's own record holds the check
        assert [row[0] for row in db.execute("SELECT kind FROM events WHERE kind = 'check'")] == ["check"]
    (out / "README.md").unlink()  # a resume rebuilds the card and writes the check's section back
    api.resume(out)
    assert (out / "README.md").read_bytes() == data and api.verify(out).ok
