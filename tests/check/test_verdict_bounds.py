"""The verdict's absolute bounds and what a check compares (issue 70, item 2): a model worse than guessing uniformly
is ``broken`` with no base or parent to compare with, and the report says that nothing was compared; a merge as bad
as its worst parent is ``broken`` and names that parent; a mergekit output's base and parents come from its
``mergekit_config.yml``; a recorded model that is gone, and an output still being written, are each one line that
says so.

The real behaviour on SmolLM2-135M-Instruct (:mod:`realmodel`: layer 15's matrices ×10, NLL 13.8 nats per token
against ln 49,152 = 10.8); the records and refusals on tiny generated models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import cli, write_config

from resumerge import api
from resumerge.analyses.check.report import BROKEN, WORKS
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import StateDir
from resumerge.errors import UsageError

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = "The quick brown fox jumps over the lazy dog.\nIn 1492, Columbus sailed across the Atlantic Ocean.\n"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from realmodel import edited_copy, smollm2_folder

    base = smollm2_folder()
    root = tmp_path_factory.mktemp("bounds")

    def times_ten(name: str, t: Any) -> Any:  # layer 15's matrices ×10: the model is worse than a guess
        return t * 10 if name.startswith("model.layers.15.") and t.dim() == 2 else t

    texts = root / "texts.txt"
    texts.write_text(TEXTS)
    return {"base": base, "destroyed": edited_copy(base, root / "destroyed", times_ten), "texts": texts}


@pytest.mark.slow
def test_a_model_worse_than_a_uniform_guess_is_broken_with_nothing_to_compare(real: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    done = cli("check", real["destroyed"], "--prompts", real["texts"], "--json", "--state-dir", tmp_path,
               timeout=600)
    assert done.returncode == 6, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["verdict"] == BROKEN and [m["role"] for m in doc["models"]] == ["merge"]
    assert doc["models"][0]["nll"] > 1.1 * 10.80  # ln 49,152
    assert any("guessing uniformly among its 49,152 tokens" in r for r in doc["reasons"]), doc["reasons"]
    assert doc["compared"].startswith("nothing: no base or parent was given or recorded")
    # The trained model itself, alone: works, and the report says it was compared with nothing.
    alone = api.check(real["base"], prompts=real["texts"], settings=api.Settings(state_dir=tmp_path))
    assert alone.verdict == WORKS and alone.compared is not None and alone.compared.startswith("nothing")


@pytest.mark.slow
def test_a_merge_as_bad_as_its_worst_parent_is_broken_and_names_it(real: dict[str, Path], tmp_path: Path) -> None:
    config = write_config(tmp_path / "merge.yml", {"merge_method": "linear", "models": [
        {"model": str(real["base"]), "parameters": {"weight": 0.5}},
        {"model": str(real["destroyed"]), "parameters": {"weight": 0.5}}]})
    out, state = tmp_path / "out", tmp_path / "state"
    api.run(config, out, settings=api.Settings(state_dir=state))
    report = api.check(out, prompts=real["texts"],
                       settings=api.Settings(state_dir=state))  # the parents from its record
    assert report.verdict == BROKEN and report.compared == "the merge with 2 parent(s)", report.reasons
    assert any(r.startswith(f"as bad as its worst parent {real['destroyed']} ") for r in report.reasons), \
        report.reasons


def _mergekit_output(root: Path, names: dict[str, str]) -> Path:
    """A folder as mergekit writes one: the merged model and the config it merged."""
    out = make_model(root / "out", SPEC, seed=9)
    (out / "mergekit_config.yml").write_text(
        f"merge_method: task_arithmetic\nbase_model: {names['base']}\nmodels:\n"
        + "".join(f"  - model: {names[p]}\n    parameters: {{weight: 0.5}}\n" for p in ("p1", "p2")))
    return out


def test_a_mergekit_outputs_base_and_parents_come_from_its_config(tmp_path: Path) -> None:
    names = {k: str(make_model(tmp_path / k, SPEC, seed=i)) for i, k in enumerate(("base", "p1", "p2"))}
    out = _mergekit_output(tmp_path, names)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    report = api.check(out, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    assert [(m.role, m.path) for m in report.models] == [
        ("merge", str(out)), ("base", names["base"]), ("parent", names["p1"]), ("parent", names["p2"])]
    assert report.compared == "the merge with its base and 2 parent(s)"


def test_a_recorded_parent_that_is_gone_is_named_as_recorded(tmp_path: Path) -> None:
    names = {k: str(make_model(tmp_path / k, SPEC, seed=i)) for i, k in enumerate(("base", "p1"))}
    names["p2"] = str(tmp_path / "gone")
    out = _mergekit_output(tmp_path, names)
    with pytest.raises(UsageError) as refused:
        api.check(out, settings=api.Settings(state_dir=tmp_path / "state"))
    line = refused.value.one_line()
    assert line.startswith(f"{out / 'mergekit_config.yml'} names the parent {tmp_path / 'gone'}: no such model "
                           "folder — give the models with --base and --parent"), line
    assert "--parent " + str(tmp_path / "gone") not in line


def test_an_output_still_being_written_is_said_to_be(tmp_path: Path) -> None:
    from resumerge.machine.runlock import RunLock

    a, b = make_model(tmp_path / "a", SPEC, seed=0), make_model(tmp_path / "b", SPEC, seed=1)
    config = write_config(tmp_path / "merge.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, "--quiet", env={"RESUMERGE_KILL_AT": "after_ledger_commit"},
                 timeout=300)
    assert killed.returncode == -9 and not (out / "config.json").exists(), killed.stderr
    with pytest.raises(UsageError) as unfinished:
        api.check(out, settings=api.Settings(state_dir=state))
    assert unfinished.value.one_line() == (f"the merge into {out} is not finished — finish it with resumerge resume "
                                           f"{out} --state-dir {state}, then check it")
    lock = RunLock(StateDir.resolve(state).run_dir(out), out)
    lock.acquire()  # as the merge holds it while it runs
    try:
        with pytest.raises(UsageError, match="is still being written: a merge into it is running"):
            api.check(out, settings=api.Settings(state_dir=state))
    finally:
        lock.release()


def test_a_model_identical_to_the_base_given_alone_has_no_effect(tmp_path: Path) -> None:
    # issue 87: `check MODEL --base BASE` of a model equal to BASE was "works" (no parent to measure it against)
    import shutil

    from resumerge.analyses.check.report import NO_EFFECT

    base = make_model(tmp_path / "base", SPEC, seed=0)
    same = tmp_path / "same"
    shutil.copytree(base, same)
    report = api.check(same, base=base, settings=api.Settings(state_dir=tmp_path / "state"))
    assert report.verdict == NO_EFFECT and report.exit_code == 5, report.reasons
    assert any("indistinguishable from the base" in r for r in report.reasons), report.reasons
