"""The Python API mirrors the CLI; every command is documented; status stays off the heavy imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import cli, digests, linear_config, write_config

import resumerge
from resumerge.cli.commands import build_parser, entry, main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("run", "resume", "status", "verify", "plan", "demo", "extract-lora", "tokensurgeon", "check", "eval",
            "measure")


def test_api_and_cli_give_identical_outputs(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    outcome = resumerge.run(cfg, tmp_path / "api",
                            settings=resumerge.Settings(output=resumerge.Output(out_shard_size="30k")))
    assert main(["run", str(cfg), str(tmp_path / "cli"), "--out-shard-size", "30k", "--quiet"]) == 0
    assert digests(tmp_path / "api") == digests(tmp_path / "cli")
    planned = resumerge.plan_merge(cfg, settings=resumerge.Settings(output=resumerge.Output(out_shard_size="30k")))
    assert outcome.plan.fingerprint == planned.fingerprint
    report = resumerge.status(tmp_path / "api")
    assert report.state == "done" and report.shards_done == report.shards_total
    assert resumerge.verify(tmp_path / "api").ok
    assert resumerge.resume(tmp_path / "api").resumed_files == len(report.files)


def test_every_api_call_is_exported_at_the_top() -> None:
    """``resumerge.NAME`` is ``resumerge.api.NAME`` for every name the API exports (issue 83: ``resumerge.evaluate``
    raised AttributeError, the top's list having been copied by hand), but a name one of the package's own modules
    holds (``resumerge.lm_eval``, once imported), and every public call is exported."""
    import pkgutil

    from resumerge import api

    own = {each.name for each in pkgutil.iter_modules(resumerge.__path__)}
    assert set(api.__all__) & own == {"lm_eval"}  # another: its module renamed, or the call
    assert set(resumerge.__all__) == set(api.__all__) - own | {"__version__"}
    assert {"evaluate", "open_unwritten", "EvolveOutcome", "evolve_status"} <= set(resumerge.__all__)
    for name in set(api.__all__) - own:
        assert getattr(resumerge, name) is getattr(api, name), name
        assert name in dir(resumerge)
    # and a new public function of a module the API's calls live in (one the package imports a call from) is a
    # name of api.__all__, hence of resumerge's, with no list kept here
    import importlib
    import inspect

    from resumerge.api import reading

    homes = {reading.__name__} | {module for name, module in api._homes().items()
                                  if inspect.isfunction(getattr(importlib.import_module(module), name))}
    assert {"resumerge.api.calls", "resumerge.api.transplanting", "resumerge.api.reading"} <= homes
    for home in sorted(homes):
        module = importlib.import_module(home)
        public = {name for name, value in vars(module).items()
                  if inspect.isfunction(value) and value.__module__ == home and not name.startswith("_")}
        assert public - {"named"} <= set(api.__all__), home  # named: the rule on every OUT the calls share


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_and_is_in_the_readme(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    assert len(capsys.readouterr().out) > 100
    assert f"resumerge {command}" in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line.strip() for line in ci.splitlines() if "pytest" in line and "pip install" in line)
    assert test_command in readme


def test_the_resumerge_command_points_at_the_cli() -> None:
    # The README's first command is `resumerge demo`: the console script must name a function that exists (a
    # package move once left it pointing at `resumerge.cli:main`, and every test ran `python -m resumerge`).
    import importlib
    import re
    from importlib.metadata import entry_points

    declared = re.search(r'^resumerge = "([\w.]+):(\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert getattr(importlib.import_module(declared.group(1)), declared.group(2)) is entry
    installed = [e for e in entry_points(group="console_scripts") if e.name == "resumerge"]
    assert [e.value for e in installed] == [f"{declared.group(1)}:{declared.group(2)}"]
    assert installed[0].load() is entry


@pytest.mark.parametrize(("code", "teardown"), [(0, False), (2, True), (3, True)])
def test_a_finished_command_exits_without_the_interpreters_teardown(code: int, teardown: bool) -> None:
    # Success skips the teardown (torch's takes most of a second) but still delivers everything written to a
    # pipe and the logs; any other code exits normally, running what the interpreter runs at exit.
    script = ("import atexit, logging, sys\n"
              "from resumerge.cli.commands import exit_with\n"
              "atexit.register(lambda: print('teardown', flush=True))\n"
              "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
              "logging.warning('logged')\n"
              f"print('out', end=''); sys.stderr.write('err'); exit_with({code})\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == code
    assert done.stdout == ("outteardown\n" if teardown else "out")
    assert done.stderr == "logged\nerr"


def test_a_stopped_or_refused_command_ends_without_collecting_what_it_holds() -> None:
    # Its threads joined and its exit handlers run as at any exit, but the objects it holds frozen: collecting them
    # was most of the teardown (an evaluation's Ctrl-C took 1.0-1.25 CPU s to end after its last line).
    script = ("import atexit, gc, sys, threading, time\n"
              "from resumerge.cli.commands import exit_with\n"
              "held = [[i] for i in range(1000)]\n"
              "worker = threading.Thread(target=lambda: (time.sleep(0.2), print('joined', flush=True)))\n"
              "worker.start()\n"
              "atexit.register(lambda: print('frozen', gc.get_freeze_count() >= 1000, gc.isenabled(), flush=True))\n"
              "exit_with(3)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "joined\nfrozen True False\n"


def test_plan_times_compute_with_the_runs_threads_and_refuses_a_missing_gpu(
        tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "ties", "base_model": str(a), "dtype": "float32",
                                            "models": [{"model": str(b), "parameters": {"weight": 1, "density": 0.5}}]})
    threads = torch.get_num_threads()
    try:
        assert main(["plan", str(cfg), "--json", "--probe-size", "0", "-j", "1"]) == 0
        groups = json.loads(capsys.readouterr().out)["time"]["compute"]
    finally:
        torch.set_num_threads(threads)
    assert [(g["method"], g["device"], g["threads"]) for g in groups] == [("ties", "cpu", 1)]
    if not torch.cuda.is_available():
        assert main(["plan", str(cfg), "--cuda"]) == 2
        assert "torch sees no CUDA GPU" in capsys.readouterr().err


# What ``resumerge status`` must not import (issue 45: under 0.5 s a call): the heavy libraries, and resumerge's
# planner, inputs, methods, engine and memory governor, which bring them or psutil and yaml.
STATUS_NEVER_IMPORTS = ("torch", "sqlite_utils", "safetensors", "transformers", "huggingface_hub", "hf_xet",
                        "numpy", "psutil", "yaml", "resumerge.merge.plan.merge_plan", "resumerge.inputs",
                        "resumerge.merge.methods", "resumerge.merge.engine", "resumerge.machine.memory.governor",
                        # issue 72 (status under 0.2 s): the API's option groups and calls, the settings, the
                        # recipes' and the check's report types, the sinks' threads, rich's progress display, and
                        # the standard modules only a merge uses
                        "resumerge.api.options", "resumerge.api.calls", "resumerge.api.evolution",
                        "resumerge.api.unwritten", "resumerge.config.settings", "resumerge.runs.recipes.view",
                        "resumerge.analyses.check.report", "resumerge.analyses.evaluation.report",
                        "resumerge.merge.store.sink", "rich.progress", "concurrent", "ctypes", "csv", "html")


# What ``resumerge status OUT --json`` leaves unimported besides (issue 72: status under 0.2 s, most of it start-up):
# the other commands' parser modules (only the asked command's parser is built), the terminal's rich, and the
# standard modules imported only where they are used (sizes parsed, temp names drawn, files hashed on threads).
STATUS_JSON_NEVER_IMPORTS = ("resumerge.cli.checkcmd", "resumerge.cli.evalcmd", "resumerge.cli.evolvecmd",
                             "resumerge.cli.measurecmd", "resumerge.cli.ignoredflags",
                             "resumerge.cli.render", "rich", "fractions", "secrets")


def _assert_status_imports_none(out: Path, flag_sets: tuple[list[str], ...], never: tuple[str, ...]) -> None:
    """``status OUT`` with each of ``flag_sets`` in turn, in a fresh interpreter: each exits 0 and no module named by
    (or under) ``never`` is imported."""
    probe = (
        "import sys, io, contextlib\n"
        "from resumerge.cli.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    codes = [main(['status', {str(out)!r}, *flags]) for flags in {flag_sets!r}]\n"
        f"extra = sorted(m for m in sys.modules if m.startswith({never!r}))\n"
        "print(codes, extra)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"{[0] * len(flag_sets)} []", done.stdout + done.stderr


def test_status_never_imports_torch_or_the_planner(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 0
    _assert_status_imports_none(tmp_path / "out", ([], ["--json"]), STATUS_NEVER_IMPORTS)
    # --json alone: nothing of the terminal's, nor of the other commands' parsers
    _assert_status_imports_none(tmp_path / "out", (["--json"],), STATUS_JSON_NEVER_IMPORTS + STATUS_NEVER_IMPORTS)


def test_the_ledger_imports_no_pandas() -> None:
    """sqlite-utils imports pandas when it is installed (70 MB of every run's resident memory): the ledger hides it
    from that import, and pandas still imports afterwards."""
    pytest.importorskip("pandas")
    probe = (
        "import sys\n"
        "import resumerge.merge.store.ledger, resumerge.merge.store.journal, resumerge.runs.recipes.ledger\n"
        "hidden = 'pandas' not in sys.modules\n"
        "import pandas\n"
        "print(hidden, pandas.DataFrame is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True True", done.stdout + done.stderr


def test_plan_command_writes_nothing(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    a = make("a")
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(a)]})
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["plan", str(cfg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] > 0 and doc["shards"] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_mergekit_flags_are_accepted(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    args = ["run", str(cfg), str(tmp_path / "out"), "--no-cuda", "--lazy-unpickle", "--clone-tensors",
            "--copy-tokenizer", "--allow-crimes", "-j", "2", "--write-threads", "2", "--trust-remote-code"]
    assert main(args) == 0
    assert "--lazy-unpickle is not needed" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_without_dir_leaves_the_current_directory_alone_and_says_where_it_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, state = tmp_path / "a-clone", tmp_path / "state"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the command's working directory: forked or fresh, it starts in this process's
    done = cli("demo", env={"RESUMERGE_STATE_DIR": str(state)}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(cwd.iterdir()) == []
    where = state / "demo"
    assert done.stdout.splitlines()[0].startswith(f"resumerge demo in {where}")
    assert f"everything is in {where}" in done.stdout and "byte-identical to the uninterrupted run: yes" in done.stdout
    # one count of OUT's files: verify's committed files are the demo's, OUT holding the manifest besides
    verified = re.search(r"ok: (\d+) committed files", done.stdout)
    compared = re.search(r"out/ holds (\d+) committed files and resumerge-manifest.json", done.stdout)
    assert verified and compared and verified[1] == compared[1], done.stdout
    assert "no input file changed" not in done.stdout
    assert (where / "merge.yml").is_file() and (where / "out" / "model.safetensors.index.json").is_file()


def test_str_of_an_error_is_the_cli_line_in_the_apis_words(tmp_path: Path, make: ModelFactory,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """str(ConfigError) dropped the YAML path and hint the CLI prints, and named options by their CLI flags."""
    from resumerge import api
    from resumerge.errors import ConfigError, UsageError

    a = make("a", seed=1)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 9]}]}]})
    with pytest.raises(ConfigError) as bad:
        api.run(cfg, tmp_path / "out")
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == bad.value.exit_code == 2
    assert capsys.readouterr().err == f"error: {bad.value}\n"  # no flag in it: the CLI's line exactly
    assert str(bad.value).startswith("slices[0].sources[0].layer_range: ") and "— use an end of at most" in str(
        bad.value)
    with pytest.raises(UsageError) as lots:
        api.run(cfg, tmp_path / "out", settings=api.Settings(resources=api.Resources(max_memory="lots")))
    assert str(lots.value).startswith("max_memory: invalid size 'lots' — write a number"), str(lots.value)
    assert lots.value.one_line().startswith("--max-memory: invalid size")  # what the CLI prints
    assert lots.value.exit_code == 2


def test_a_notebook_sees_a_short_outcome_and_a_readable_status(tmp_path: Path, make: ModelFactory) -> None:
    """repr(api.run(...)) dumped the whole plan (51,768 characters for 57 tensors); status was a dataclass repr."""
    import re

    from resumerge import api

    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    out = tmp_path / "out"
    outcome = api.run(cfg, out, settings=api.Settings(state_dir=tmp_path / "state",
                                                      output=api.Output(out_shard_size="30k")))
    files = len(list(out.iterdir())) - 1  # every file but the manifest
    assert re.fullmatch(rf"done: {re.escape(str(out))}, {files} files, 0 resumed, \d+\.\d s", repr(outcome)), \
        repr(outcome)
    report = api.status(out, settings=api.Settings(state_dir=tmp_path / "state"))
    text = str(report)
    assert text.splitlines()[0] == f"{out}: done (from the ledger)"
    assert re.search(r"^shards +\d+ of \d+ \(100 % of bytes\)$", text, re.M) and "tensors" in text, text
    page = report._repr_html_()
    assert page.startswith("<div><b>") and "<table>" in page and "<th style='text-align:left'>shards</th>" in page
