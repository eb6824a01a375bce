"""Everyday use as a new user tries it (issue 31): a deleted or moved OUT, and the rough edges of the front door."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ModelFactory
from support import cli, linear_config, write_config

from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import LEDGER_NAME, run_dir
from resumerge.errors import UsageError
from resumerge.machine.runlock import RunLock


def _configs(tmp_path: Path, make: ModelFactory) -> tuple[Path, Path]:
    a, b = make("a", seed=1), make("b", seed=2)
    return (write_config(tmp_path / "a.yml", linear_config(a, b)),
            write_config(tmp_path / "b.yml", linear_config(a, b, weights=(0.4, 0.6))))


def test_a_deleted_out_takes_a_changed_config(tmp_path: Path, make: ModelFactory,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """run a.yml out, rm -rf out, run b.yml out: OUT holds nothing, so the stale record is set aside (one line)."""
    first, second = _configs(tmp_path, make)
    out = tmp_path / "out"
    assert main(["run", str(first), str(out), "--quiet"]) == 0
    shutil.rmtree(out)
    capsys.readouterr()
    assert main(["run", str(second), str(out)]) == 0
    said = capsys.readouterr()
    assert "planned differently" not in said.err
    assert said.err.count("set aside") == 1 and "OUT holds no merge" in said.err
    assert (out / "resumerge-manifest.json").is_file()


def test_a_refused_run_leaves_no_empty_out(tmp_path: Path, make: ModelFactory) -> None:
    """A run refused after OUT was named (here: another process holds the run's lock) leaves no empty OUT."""
    first, _ = _configs(tmp_path, make)
    out, state = tmp_path / "out", tmp_path / "state"
    rdir = run_dir(out, state)
    rdir.mkdir(parents=True)
    other = RunLock(rdir, out, lock_out=False)
    other.acquire()
    try:
        assert main(["run", str(first), str(out), "--state-dir", str(state), "--quiet"]) == 4
    finally:
        other.release()
    assert not out.exists()


def test_a_resume_whose_out_moved_refuses(tmp_path: Path, make: ModelFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """mv out out2; resume out re-created out/ and redid the whole merge: it refuses and says where to resume."""
    first, _ = _configs(tmp_path, make)
    out, moved = tmp_path / "out", tmp_path / "out2"
    assert main(["run", str(first), str(out), "--quiet"]) == 0
    out.rename(moved)
    capsys.readouterr()
    assert main(["resume", str(out)]) == 4
    err = capsys.readouterr().err
    assert "may have moved" in err and "resumerge resume NEW_PATH" in err
    # status said "done" from the ledger, of files no longer there: it says what resume says.
    assert main(["status", str(out)]) == 4
    assert capsys.readouterr().err == err
    assert not out.exists()
    assert main(["resume", str(moved), "--quiet"]) == 0


@pytest.mark.parametrize("command", ["run", "resume", "status", "verify", "plan"])
def test_an_empty_out_is_a_usage_error(command: str, tmp_path: Path, make: ModelFactory,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """run cfg.yml "" took the current directory as OUT."""
    first, _ = _configs(tmp_path, make)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [str(first), ""] if command in ("run", "plan") else [""]
    assert main([command, *args, "--probe-size", "0"] if command == "plan" else [command, *args]) == 2
    assert "OUT is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_one_line_yaml_text_is_a_config_not_a_missing_file(tmp_path: Path, make: ModelFactory) -> None:
    """api._config_text took any str without a newline for a path: a one-line YAML config was "not found"."""
    a, b = make("a", seed=1), make("b", seed=2)
    one_line = yaml.safe_dump(linear_config(a, b), default_flow_style=True, width=10_000).strip()
    assert "\n" not in one_line
    assert len(api.plan_merge(one_line).shards) >= 1
    named = write_config(tmp_path / "c.yml", linear_config(a, b))
    assert api.plan_merge(str(named)).fingerprint == api.plan_merge(one_line).fingerprint
    with pytest.raises(UsageError, match="not found"):
        api.plan_merge(str(tmp_path / "missing.yml"))


def test_an_unknown_flag_shows_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """run --bogus printed the top-level usage (resumerge [-h] [--version] COMMAND ...) instead of run's."""
    assert main(["run", "c.yml", "out", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage: resumerge run " in err and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("command", ["resume", "status", "verify"])
def test_help_describes_out_and_names_hub_repos(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """resume --help did not mention hf://; status --help and verify --help did not describe OUT."""
    assert main([command, "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "OUT output directory" in help_text and "hf://NAMESPACE/NAME" in help_text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_done_keeps_exit_0(signum: int, tmp_path: Path, make: ModelFactory) -> None:
    """A SIGTERM or SIGINT while the interpreter exits after "done:" (torch's teardown) gave 143/130."""
    first, _ = _configs(tmp_path, make)
    # A fresh interpreter, not support.cli_start: its stderr is read line by line as it runs, and what is tested is
    # the exit of an interpreter that started as `python -m resumerge` does.
    with subprocess.Popen([sys.executable, "-m", "resumerge", "run", str(first), str(tmp_path / "out")],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as process:
        assert process.stderr is not None
        for line in process.stderr:
            if line.startswith("done:"):
                time.sleep(0.2)  # past main()'s return: into the interpreter's exit
                process.send_signal(signum)
                break
        rest = process.stderr.read()
        assert process.wait(timeout=60) == 0, rest


def _recorded_options(out: Path) -> dict[str, object]:
    options: dict[str, object] = json.loads((out / "resumerge-manifest.json").read_text())["options"]
    return options


def test_the_thread_count_is_recorded_reused_and_a_different_one_refused(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """-j changes slerp's bytes but was not recorded: a resume could silently compute with another count."""
    a, b = make("a", seed=1), make("b", seed=2)
    slerp = write_config(tmp_path / "s.yml", {"merge_method": "slerp", "base_model": str(a), "models": [
        {"model": str(a)}, {"model": str(b)}], "parameters": {"t": 0.5}})
    out = tmp_path / "out"
    assert main(["run", str(slerp), str(out), "-j", "2", "--quiet"]) == 0
    assert _recorded_options(out)["num_threads"] == 2
    with sqlite3.connect(run_dir(out) / "ledger.db") as db:
        assert json.loads(db.execute("SELECT options FROM run").fetchone()[0])["num_threads"] == 2
    capsys.readouterr()
    assert main(["resume", str(out), "-j", "3"]) == 2
    assert "started with -j 2" in capsys.readouterr().err
    assert main(["resume", str(out)]) == 0
    assert "using -j 2, as the run was started with" in capsys.readouterr().err
    assert main(["run", str(slerp), str(out), "-j", "3", "--quiet"]) == 4


def test_the_thread_count_leaves_other_methods_fingerprints_alone(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    linear = write_config(tmp_path / "l.yml", linear_config(a, b))
    plain, threaded = tmp_path / "plain", tmp_path / "threaded"
    assert main(["run", str(linear), str(plain), "--quiet"]) == 0
    assert main(["run", str(linear), str(threaded), "-j", "2", "--quiet"]) == 0
    assert _recorded_options(threaded)["num_threads"] is None
    fingerprints = {json.loads((o / "resumerge-manifest.json").read_text())["fingerprint"] for o in (plain, threaded)}
    assert len(fingerprints) == 1
    assert main(["resume", str(threaded), "-j", "3", "--quiet"]) == 0


@pytest.mark.parametrize("kind", ["merge", "recipe"])
def test_an_unreachable_hub_before_anything_started_is_exit_2(tmp_path: Path, kind: str) -> None:
    """A hub id with no network was exit 3 ("resume finishes it") though nothing was started."""
    home = tmp_path / "hf"
    env = {"HF_ENDPOINT": "http://127.0.0.1:9",  # the discard port: connection refused
           "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN_PATH": str(home / "token"),
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": "someorg/one", "parameters": {"weight": 0.5}},
        {"model": "someorg/two", "parameters": {"weight": 0.5}}]})
    if kind == "recipe":  # a stage named "mid", then a final merge of it
        stage = {"name": "mid", **yaml.safe_load(cfg.read_text())}
        final = {"merge_method": "linear", "models": [{"model": "mid", "parameters": {"weight": 0.5}},
                                                      {"model": "someorg/two", "parameters": {"weight": 0.5}}]}
        cfg.write_text(yaml.safe_dump_all([stage, final]))
    out = tmp_path / "out"
    done = cli("run", cfg, out, "--state-dir", tmp_path / "state", "--quiet", env=env)
    assert done.returncode == 2, done.stderr
    assert "cannot reach http://127.0.0.1:9" in done.stderr and "nothing was started" in done.stderr
    assert not out.exists()
    # plan writes nothing whatever happens: exit 3's "resume finishes it" was wrong there too (issue 71, item 5)
    planned = cli("plan", cfg, out, "--state-dir", tmp_path / "state", env=env)
    assert planned.returncode == 2, planned.stderr
    assert planned.stderr.startswith("error: ") and planned.stderr.count("\n") == 1, planned.stderr
    assert "cannot reach http://127.0.0.1:9" in planned.stderr and "plan writes nothing" in planned.stderr
    assert "resume" not in planned.stderr and not out.exists()


def test_status_of_a_moved_recipe_out_finds_its_final_stage(tmp_path: Path, make: ModelFactory) -> None:
    """With OUT moved and the state dir gone, status said "1 of 2 stages done" with the final stage pending at the
    old path: the final stage always writes to OUT, wherever OUT is now."""
    a, b = make("a", seed=1), make("b", seed=2)
    first = {"name": "first", **linear_config(a, b)}
    second = {"merge_method": "linear", "models": [{"model": "first", "parameters": {"weight": 0.5}},
                                                    {"model": str(b), "parameters": {"weight": 0.5}}]}
    recipe = tmp_path / "r.yml"
    recipe.write_text(yaml.safe_dump(first) + "---\n" + yaml.safe_dump(second))
    out, moved, state = tmp_path / "out", tmp_path / "out2", tmp_path / "state"
    assert main(["run", str(recipe), str(out), "--state-dir", str(state), "--quiet"]) == 0
    out.rename(moved)
    shutil.rmtree(state)
    report = api.recipe_status(moved, settings=api.Settings(state_dir=state))
    final = report.stages[-1]
    assert (final.state, final.out_dir) == ("done", str(moved))
    assert report.stages_done == 2


def test_a_recipe_records_the_thread_count_of_its_stages_and_its_resume_reuses_it(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """A recipe's resume computed with whatever -j it was given, though its slerp stage's bytes depend on it."""
    a, b = make("a", seed=1), make("b", seed=2)
    stage = {"name": "mid", "merge_method": "slerp", "base_model": str(a),
             "models": [{"model": str(a)}, {"model": str(b)}], "parameters": {"t": 0.5}}
    final = {"merge_method": "linear", "models": [{"model": "mid", "parameters": {"weight": 0.5}},
                                                  {"model": str(b), "parameters": {"weight": 0.5}}]}
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(yaml.safe_dump_all([stage, final]))
    out = tmp_path / "out"
    assert main(["run", str(recipe), str(out), "-j", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["resume", str(out), "-j", "3"]) == 2
    assert "started with -j 2" in capsys.readouterr().err
    assert main(["resume", str(out)]) == 0
    assert "using -j 2, as the run was started with" in capsys.readouterr().err


def test_an_unreachable_hub_once_a_run_is_recorded_is_exit_3_with_resume(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """session.run_merge made every unreachable hub input exit 2 ("nothing was started: run the same command
    again") though the run had a ledger and committed shards: that is the front door's rule for a new run only."""
    from resumerge.errors import InterruptedMerge
    from resumerge.inputs.hub.remote import HubUnavailableError
    from resumerge.merge.engine import session

    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    out, state = tmp_path / "out", tmp_path / "state"
    # Stopped once a shard is committed (7 shards of 20 KB): a stop after a count of polls left none committed
    # when the writer thread lagged the units under load.
    with pytest.raises(InterruptedMerge):
        api.run(cfg, out, settings=api.Settings(output=api.Output(out_shard_size="20KB"), state_dir=state),
                should_stop=lambda: any(out.glob("*.safetensors")))
    assert (run_dir(out, state) / LEDGER_NAME).exists() and any(out.glob("*.safetensors"))

    def unreachable(*_: object, **__: object) -> None:
        raise HubUnavailableError("cannot reach http://127.0.0.1:9, and someorg/one is not in the hub cache")

    monkeypatch.setattr(session, "prepare", unreachable)
    capsys.readouterr()
    code = main(["run", str(cfg), str(out), "--out-shard-size", "20KB", "--state-dir", str(state), "--quiet"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3, err
    assert "nothing was started" not in err
    assert f"run resumerge resume {out} --state-dir {state} when the hub answers" in err, err


def test_resume_given_the_config_says_it_takes_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``resumerge resume merge.yml`` said "choose a new or empty directory for the output", a run's advice."""
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": []})
    code = main(["resume", str(cfg), "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "resume takes the output folder a run wrote into (its OUT), not the run's config" in err, err
    assert "new or empty directory" not in err


@pytest.mark.parametrize("command", ["run", "plan"])
def test_an_out_on_a_read_only_folder_is_one_line_exit_2(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: str) -> None:
    """OUT under a read-only folder (a read-only mount) was "internal error: OSError: [Errno 30] Read-only file
    system" (exit 1) once the plan was made, and plan said "fits". The folder is read-only by access(2)'s answer
    here, as tests may run as root, whom file modes do not stop."""
    import os

    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    frozen = tmp_path / "ro"
    frozen.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != frozen and real(p, mode, **kw))
    capsys.readouterr()
    quiet = ["--quiet"] if command == "run" else []
    code = main([command, str(cfg), str(frozen / "out"), "--state-dir", str(tmp_path / "state"), *quiet])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"OUT {frozen / 'out'} is not writable ({frozen} is read-only here); choose an OUT on a writable " \
           "filesystem" in err, err
    assert "internal error" not in err and not (frozen / "out").exists()
