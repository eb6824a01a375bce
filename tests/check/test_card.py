"""A finished check writes its section into the model card of a resumerge output: the verdict, each model's NLL
and KL, the layer named, the thresholds, the prompts and the drift chart; the card's new checksum is recorded (ledger
row and manifest), so ``verify`` passes; checking again replaces the section; a card resumerge did not write, or one
edited since, is never touched; a hub OUT's card is left as committed, said in one line.

Tiny generated models (two layers, width 32, a byte-level tokenizer): each check is a second or two."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import xxhash

from resumerge import api
from resumerge.analyses.check.card import BEGIN, END, render_section, update_card
from resumerge.analyses.check.report import CheckReport, ModelFigures, StaticFigures
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import RunLocations, StateDir
from resumerge.merge.store.manifest import manifest_path, read_manifest

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)


def _merged(root: Path, *, card: bool = True) -> tuple[Path, Path, list[Path]]:
    parents = [make_model(root / f"p{i}", SPEC, seed=i) for i in range(2)]
    config = root / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    out, state = root / "out", root / "state"
    api.run(config, out, settings=api.Settings(state_dir=state, output=api.Output(write_model_card=card)))
    return out, state, parents


def _card_record(out: Path, state: Path) -> tuple[tuple[int, str], dict[str, object]]:
    with sqlite3.connect(RunLocations.of(out, state).ledger) as db:
        size, sha = db.execute("SELECT bytes, sha256 FROM files WHERE name = 'README.md'").fetchone()
    manifest = read_manifest(out)
    assert manifest is not None
    return (size, sha), dict(manifest.committed["README.md"])


def test_a_check_writes_its_section_into_the_card_and_verify_still_passes(tmp_path: Path) -> None:
    out, state, _ = _merged(tmp_path)
    before = (out / "README.md").read_text()
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world again\n")
    report = api.check(out, prompts=texts, settings=api.Settings(state_dir=state))
    card = (out / "README.md").read_text()
    assert card.startswith(before.rstrip("\n")) and card.count(BEGIN) == 1 and card.count(END) == 1
    section = card[card.index(BEGIN):]
    assert f"**{report.verdict.replace('_', ' ')}** (exit {report.exit_code})" in section
    for m in report.models:  # each model's NLL, and the merge's KL from each parent, by its folder's name
        assert f"| {m.role} | {Path(m.path).name} | {m.nll:.4f} |" in section
        if m.kl is not None:
            assert f"| {m.kl:.4g} |" in section
    assert "Broken layer: none." in section and "nll_factor 1.5" in section
    assert f"texts.txt (sha256 {hashlib.sha256(texts.read_bytes()).hexdigest()})" in section
    assert report.chart is not None and "`drift.png` in the check's folder" in section
    assert f"(`checks/{Path(report.chart).parent.name}/`)" in section and str(tmp_path) not in section
    assert report.card is not None and "section written" in report.card
    # The new bytes are recorded the way every output file is: the ledger's row and the manifest agree with them.
    data = (out / "README.md").read_bytes()
    ledger_row, manifest_entry = _card_record(out, state)
    assert ledger_row == (len(data), "xxh3-128:" + xxhash.xxh3_128_hexdigest(data))  # a folder's checksum
    assert manifest_entry == {"bytes": len(data), "sha256": "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)}
    verified = api.verify(out, settings=api.Settings(state_dir=state))
    assert verified.ok, verified.damaged
    assert not [p for p in out.iterdir() if p.name.endswith(".part")]  # no temp file left behind
    # A resume of the finished output keeps the card with its section (nothing to rebuild).
    api.resume(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_bytes() == data


def test_a_card_a_resume_rebuilds_gets_the_last_checks_section_back(tmp_path: Path) -> None:
    out, state, _ = _merged(tmp_path)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world again\n")
    api.check(out, prompts=texts, settings=api.Settings(state_dir=state))
    checked = (out / "README.md").read_bytes()
    (out / "README.md").unlink()  # the resume makes it again from the plan, which knows nothing of the check
    api.resume(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_bytes() == checked  # the section written back from the check's record
    ledger_row, manifest_entry = _card_record(out, state)
    assert ledger_row == (len(checked), "xxh3-128:" + xxhash.xxh3_128_hexdigest(checked))
    assert manifest_entry == {"bytes": len(checked), "sha256": "xxh3-128:" + xxhash.xxh3_128_hexdigest(checked)}
    assert api.verify(out, settings=api.Settings(state_dir=state)).ok


def test_checking_again_replaces_the_section_and_never_adds_a_second(tmp_path: Path) -> None:
    out, state, _ = _merged(tmp_path)
    api.check(out, settings=api.Settings(state_dir=state))  # built-in texts
    first = (out / "README.md").read_bytes()
    # the same check: its report from the journal, the card unchanged
    again = api.check(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_bytes() == first and again.card is not None and "up to date" in again.card
    texts = tmp_path / "texts.txt"
    texts.write_text("one two three four five\n")
    other = api.check(out, prompts=texts,
                      settings=api.Settings(state_dir=state))  # another check: its section replaces the first
    card = (out / "README.md").read_text()
    assert card.count(BEGIN) == 1 and card.count("## Check") == 1
    assert "texts.txt (sha256" in card and "built-in" not in card and f"{other.tokens} predicted tokens" in card
    assert card.split(BEGIN)[0] == first.decode().split(BEGIN)[0]  # the rest of the card untouched
    assert api.verify(out, settings=api.Settings(state_dir=state)).ok


def test_a_card_resumerge_did_not_write_or_one_edited_since_is_left_alone(tmp_path: Path) -> None:
    out, state, _ = _merged(tmp_path / "no-card", card=False)  # --no-write-model-card: the README is the user's
    (out / "README.md").write_text("# my own notes\n")
    report = api.check(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_text() == "# my own notes\n"
    assert report.card is not None and "was not written by resumerge" in report.card
    out, state, _ = _merged(tmp_path / "edited")
    edited = (out / "README.md").read_text() + "\nA line a person added.\n"
    (out / "README.md").write_text(edited)
    report = api.check(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_text() == edited
    assert report.card is not None and "no longer matches what resumerge wrote" in report.card


def test_without_the_runs_ledger_the_card_is_left_alone_and_said_so(tmp_path: Path) -> None:
    out, state, parents = _merged(tmp_path)
    shutil.rmtree(state)  # a fresh machine: OUT's manifest is the only record of the run
    fresh = tmp_path / "fresh-state"
    card, manifest = (out / "README.md").read_bytes(), manifest_path(out).read_bytes()
    report = api.check(out, parents=parents, settings=api.Settings(state_dir=fresh))
    # Changed through the manifest alone, the card would disagree with a ledger kept elsewhere (issue 70).
    assert (out / "README.md").read_bytes() == card and manifest_path(out).read_bytes() == manifest
    assert report.card is not None and "left as it is" in report.card and "the run's ledger is neither" in report.card
    assert api.verify(out, settings=api.Settings(state_dir=fresh)).ok


def test_a_folder_that_is_no_resumerge_output_gets_no_card_and_no_line(tmp_path: Path) -> None:
    parents = [make_model(tmp_path / f"p{i}", SPEC, seed=i) for i in range(2)]
    (parents[0] / "README.md").write_text("# someone's model\n")
    report = api.check(parents[0], parents=[parents[1]], settings=api.Settings(state_dir=tmp_path / "state"))
    assert report.card is None and (parents[0] / "README.md").read_text() == "# someone's model\n"
    assert json.loads(json.dumps(report.to_json()))["card"] is None


def test_a_hub_out_is_skipped_in_one_line_and_the_broken_layer_is_named(tmp_path: Path) -> None:
    report = CheckReport(verdict="broken", reasons=("layer 3: departs",), broken_layer=3,
                         models=(ModelFigures("merge", "m", nll=9.0), ModelFigures("parent", "p", nll=2.0, kl=4.5)),
                         static=StaticFigures({}, (), (), (), ()), sequences=1, tokens=7, thresholds={"x": 1.0},
                         prompts="built-in (4 texts)")
    line = update_card("hf://org/merged", StateDir.resolve(tmp_path / "state"), report)
    assert line is not None and "hf://org/merged" in line and "\n" not in line
    section = render_section(report)
    assert "**broken** (exit 6)" in section and "Broken layer: decoder layer 3 (0-based)." in section
    assert "| parent | p | 2.0000 | 4.5 |" in section and "Prompts: built-in (4 texts)." in section


def test_a_one_off_check_against_another_model_leaves_the_card_as_it_is(tmp_path: Path) -> None:
    out, state, parents = _merged(tmp_path)
    own = api.check(out, settings=api.Settings(state_dir=state))  # against its own parents: the section written
    card = (out / "README.md").read_bytes()
    stranger = make_model(tmp_path / "stranger", SPEC, seed=7)
    other = api.check(out, parents=[stranger], settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_bytes() == card  # its card still describes the merge beside its own parents
    assert other.card is not None and "left as it is" in other.card and "parent p0, parent p1" in other.card
    one = api.check(out, parents=[parents[0]],
                    settings=api.Settings(state_dir=state))  # one of its own, the other left out: the same
    assert (out / "README.md").read_bytes() == card and one.card is not None and "parent p1" in one.card
    assert own.card is not None and "section written" in own.card
    # A resume that rebuilds the card restores the section of the check against its own parents, not the newest.
    (out / "README.md").unlink()
    api.resume(out, settings=api.Settings(state_dir=state))
    assert (out / "README.md").read_bytes() == card and api.verify(out, settings=api.Settings(state_dir=state)).ok
