"""Where the ledger lives when no --state-dir is given: the user's own state dir, found from any working directory;
runs recorded under ./state (the earlier default) keep being found from their directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ModelFactory
from support import cli, cli_here, linear_config, write_config

from resumerge.cli.commands import main
from resumerge.config.locations import RunLocations, StateDir, default_state_root, resume_command, run_dir, state_root


@pytest.fixture
def no_state_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No RESUMERGE_STATE_DIR; XDG_STATE_HOME in tmp (the suite never writes to the real home)."""
    monkeypatch.delenv("RESUMERGE_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "resumerge"


def test_the_default_state_dir_is_per_user(no_state_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert state_root() == no_state_env
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_root() == tmp_path / "home" / ".local" / "state" / "resumerge"
    monkeypatch.setenv("RESUMERGE_STATE_DIR", str(tmp_path / "mine"))
    assert state_root() == tmp_path / "mine" and state_root(tmp_path / "flag") == tmp_path / "flag"


def _status(out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    doc: dict[str, object] = json.loads(capsys.readouterr().out)
    return doc


def test_status_finds_the_ledger_from_another_directory(
        no_state_env: Path, tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With ./state, status from another directory missed the ledger and fell back to the manifest."""
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    out, here, there = tmp_path / "out", tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    monkeypatch.chdir(here)
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    assert run_dir(out).parent == no_state_env and (run_dir(out) / "ledger.db").is_file()
    assert not (here / "state").exists()
    monkeypatch.chdir(there)
    assert _status(out, capsys)["source"] == "ledger"


def test_a_run_recorded_under_dot_state_keeps_being_found_there(
        no_state_env: Path, tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(cfg), str(out), "--quiet", "--state-dir", "state"]) == 0  # where earlier versions wrote
    assert run_dir(out) == tmp_path / "state" / run_dir(out, tmp_path / "state").name
    assert _status(out, capsys)["source"] == "ledger"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0  # the same run, found: nothing to redo
    assert not no_state_env.exists()


def test_the_resume_hint_names_the_state_dir_only_when_it_is_not_the_default(
        no_state_env: Path, tmp_path: Path) -> None:
    assert resume_command("/m/out", no_state_env) == "resumerge resume /m/out"
    assert resume_command("/m/out") == "resumerge resume /m/out"
    assert resume_command("/m/out", tmp_path / "s") == f"resumerge resume /m/out --state-dir {tmp_path / 's'}"


def test_a_state_dir_that_cannot_be_written_is_refused_by_plan_and_run(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """plan said "fits", run exited 3 ("resume finishes it") and resume then found nothing to resume."""
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    (tmp_path / "a-file").write_text("")
    state, out = tmp_path / "a-file" / "state", tmp_path / "out"  # under a file: unwritable even for root
    assert main(["plan", str(cfg), str(out), "--state-dir", str(state), "--probe-size", "0"]) == 2
    said = capsys.readouterr()
    assert f"the state dir {state} cannot be created: {tmp_path / 'a-file'} is not a directory" in said.out
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--quiet"]) == 2
    assert "use a writable local state dir (--state-dir DIR or RESUMERGE_STATE_DIR)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("inside", [True, False])
def test_a_state_dir_in_out_is_refused_saying_so(tmp_path: Path, make: ModelFactory, inside: bool) -> None:
    """A state dir inside a new OUT, or OUT itself: "OUT is not empty and was not written by resumerge" (exit 4),
    for a folder that did not exist (the run's planning mark had just made it). Refused (exit 2) by run, plan and
    a recipe before anything is written, saying what is wrong."""
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    recipe = tmp_path / "r.yml"
    recipe.write_text(yaml.safe_dump_all([{"name": "first", **linear_config(a, b)}, linear_config(Path("first"), a)]))
    out = tmp_path / "out"
    state = out / "state" if inside else out
    said = f"the state dir {state} {'is inside' if inside else 'is'} OUT: resumerge keeps each run's ledger there"
    for args in (("run", cfg), ("plan", cfg, "--probe-size", "0"), ("run", recipe)):
        runner = cli if args == ("run", cfg) else cli_here  # a process once; plan and the recipe through main here
        done = runner(*args[:2], out, "--state-dir", state, *args[2:])
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
        assert f"pass a --state-dir outside OUT (or none: the default is {default_state_root()})" in done.stderr
        assert args[0] == "plan" or done.stderr.count("\n") == 1, done.stderr
        assert not out.exists()


def test_a_recipes_stages_are_placed_beside_the_locations_resolved_once(tmp_path: Path) -> None:
    # The API resolves OUT's locations once; a recipe takes each stage's beside them, under the same state dir,
    # exactly where a run into that stage's folder would keep its state (the ledger a resume and status read).
    for state_dir in (tmp_path / "state", None):
        where = RunLocations.of(tmp_path / "out", state_dir)
        stage = where.beside(tmp_path / "out.intermediates" / "mid")
        assert stage == RunLocations.of(tmp_path / "out.intermediates" / "mid", state_dir)
        assert stage.root == where.root and stage.run_dir.parent == where.run_dir.parent
        assert stage.run_dir == run_dir(tmp_path / "out.intermediates" / "mid", state_dir)
        assert stage.resume_command == resume_command(tmp_path / "out.intermediates" / "mid", state_dir)


def test_the_state_dir_is_resolved_once_and_answers_for_everything_below_the_api(
        no_state_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The front door resolves the state dir once; what the call does after an environment change still goes there.
    monkeypatch.setenv("RESUMERGE_STATE_DIR", str(tmp_path / "env"))
    state = StateDir.resolve()
    monkeypatch.setenv("RESUMERGE_STATE_DIR", str(tmp_path / "moved"))
    assert state.root == tmp_path / "env" and not state.legacy
    assert state.run(tmp_path / "out").run_dir.parent == tmp_path / "env"
    assert (state.records_dir, state.checks_dir, state.routers_dir) == (
        tmp_path / "env", tmp_path / "env" / "checks", tmp_path / "env" / "moe-routers")
    flag = StateDir.resolve(tmp_path / "flag")
    assert flag.run(tmp_path / "out") == RunLocations.of(tmp_path / "out", tmp_path / "flag")
    assert flag.resume_command(tmp_path / "out") == resume_command(tmp_path / "out", tmp_path / "flag")
    # Nothing given nor set: a run recorded under ./state is found there, as run_dir finds it.
    monkeypatch.delenv("RESUMERGE_STATE_DIR")
    monkeypatch.chdir(tmp_path)
    legacy = tmp_path / "state" / run_dir(tmp_path / "out", tmp_path / "state").name
    legacy.mkdir(parents=True)
    assert StateDir.resolve().legacy and StateDir.resolve().run_dir(tmp_path / "out") == legacy
    assert StateDir.resolve().run(tmp_path / "out").ledger == legacy / "ledger.db"
    assert StateDir.resolve(tmp_path / "flag").run_dir(tmp_path / "out").parent == tmp_path / "flag"
