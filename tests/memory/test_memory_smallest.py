"""One meaning of ``--max-memory`` (the process's resident memory, its own baseline included) and one smallest budget,
named alike by ``plan`` and ``run``, under which a real run stays (issue 71)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support import cli, linear_config, peak_rss_run, write_config

from resumerge.cli.commands import main
from resumerge.machine.memory import format_size, parse_size

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _plan(capsys: pytest.CaptureFixture[str], cfg: Path, out: Path, *options: str) -> tuple[int, dict[str, object]]:
    code = main(["plan", str(cfg), str(out), "--json", "--probe-size", "0", *options])
    return code, json.loads(capsys.readouterr().out)


@linux_only
@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_plan_and_run_name_one_smallest_budget_and_a_run_there_stays_within_it(
        tmp_path: Path, make: object, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan`` and ``run`` named 190 MB and 185 MB for one config, both below the 262 MB the process held; at 185 MB
    the run peaked at 279 MB and made 4,096 governor adaptations. Now both name one figure, refuse a byte less in
    one line (exit 2), and a run at it peaks within 5 % of it (the OS's peak RSS of the run's process)."""
    a = make("a", seed=1, hidden=512, intermediate=1024, vocab=8000)  # type: ignore[operator]
    b = make("b", seed=2, hidden=512, intermediate=1024, vocab=8000)  # type: ignore[operator]
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"

    code, doc = _plan(capsys, cfg, out)
    assert code == 0
    memory = doc["memory"]
    assert isinstance(memory, dict)
    smallest = int(memory["smallest_budget"])
    # The budget counts the whole process: a fresh run's interpreter and torch (over 100 MB) are in it.
    assert memory["baseline_bytes"] == memory["counted_baseline_bytes"] > 100_000_000
    assert smallest > memory["baseline_bytes"]
    # The named figure reads back as itself: what is printed is what works.
    assert parse_size(format_size(smallest, compact=True)) == smallest

    code, at = _plan(capsys, cfg, out, "--max-memory", str(smallest))
    assert (code, at["fits"], at["memory"]["smallest_budget"]) == (0, True, smallest)  # type: ignore[index]
    code, below = _plan(capsys, cfg, out, "--max-memory", str(smallest - 1))
    assert (code, below["fits"], below["memory"]["smallest_budget"]) == (2, False, smallest)  # type: ignore[index]
    # type: ignore[union-attr]
    assert any(f"--max-memory {format_size(smallest, compact=True)} " in r for r in below["reasons"])

    # run refuses a byte less, naming the same figure, before OUT exists.
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--quiet",
                 "--max-memory", str(smallest - 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"rerun with --max-memory {format_size(smallest, compact=True)} or more" in err, err
    assert not out.exists()

    # A real run at that budget, in a process of its own: its peak RSS as the OS measured it.
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", str(cfg), str(out), "--state-dir",
                                    str(state), "--quiet", "--max-memory", str(smallest)])
    assert code == 0, err
    assert peak <= 1.05 * smallest, (peak, smallest)
    assert main(["status", str(out), "--state-dir", str(state), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    # A budget that leaves room for one step admits each alone at worst: never thousands of adaptations.
    assert status["adaptations"] <= 20, status["adaptation_events"]


def test_a_check_or_measure_rerun_at_the_budget_it_was_told_is_not_refused_again() -> None:
    """``check`` and ``measure`` read their own process (its whole resident set): a second start reads a few hundred
    KB more or less, and a rerun at the figure the first refusal named was refused again, naming one a little
    higher."""
    from resumerge.errors import UsageError
    from resumerge.machine.memory import FakeProbe, budget_fitting

    held, step = 412_345_678, 37_000_000
    with pytest.raises(UsageError) as refused:
        budget_fitting("the check", step, 400_000_000, FakeProbe(rss=held, available=8 << 30))
    named = parse_size(refused.value.one_line().rsplit("--max-memory ", 1)[1].split()[0])
    for moved in (-2_000_000, 0, 300_000, 2_000_000):  # the next start's reading
        assert budget_fitting("the check", step, named, FakeProbe(rss=held + moved, available=8 << 30)) == named


def test_a_fresh_process_baseline_is_measured_once_and_read_from_any_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two readings of fresh processes differ by a few hundred KB: ``plan`` and ``run`` (started from any folder)
    read one measurement, kept per installation; a torn cache file is measured again, never trusted."""
    from resumerge.machine.memory import baseline

    first = baseline.fresh_baseline(("json",), tmp_path)
    assert first is not None and first > 1_000_000  # an interpreter's own RSS
    measured: list[object] = []
    monkeypatch.setattr(baseline, "_measure", lambda modules: measured.append(modules) or 123)
    monkeypatch.chdir(tmp_path)
    assert baseline.fresh_baseline(("json",), tmp_path) == first and not measured
    assert baseline.fresh_baseline(("json", "csv"), tmp_path) == 123 and measured == [("json", "csv")]
    assert baseline.fresh_baseline(("json",), tmp_path) == first  # the other figure kept beside it
    (tmp_path / "baseline.json").write_text('{"torn')
    assert baseline.fresh_baseline(("json",), tmp_path) == 123


def test_the_baselines_a_run_needs_are_measured_together_not_one_after_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with an importance pass needs three fresh baselines on an installation's first such run (each a fresh
    process importing torch, ~4.5 CPU s): every missing one is started before any is waited for, and each is
    measured once (the ones cached and the repeats left out); the figures are the ones measured alone."""
    from resumerge.machine.memory import baseline

    alone = baseline.fresh_baseline(("json",), tmp_path)
    events = _recorded_processes(monkeypatch)
    baseline.measure_ahead((("json",), ("csv",), ("json", "csv"), ("csv",)), tmp_path)
    assert events == ['start ["csv"]', 'start ["json", "csv"]', "wait", "wait"], events
    monkeypatch.setattr(baseline, "_measure", lambda modules: pytest.fail(f"measured again: {modules}"))
    figures = [baseline.fresh_baseline(each, tmp_path) for each in (("json",), ("csv",), ("json", "csv"))]
    assert figures[0] == alone and all(isinstance(f, int) and f > 1_000_000 for f in figures), figures
    events.clear()
    baseline.measure_ahead((("json",), ("csv",)), tmp_path)  # all cached: nothing started
    assert events == []


def test_the_work_several_baselines_would_each_do_is_done_once_before_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists that make a call (``module:function:argument``: loading a release's compiled kernels, which a fresh
    numba cache compiles on the first load, 27 CPU s for the 7-type release's) wait for ``prepare``'s processes,
    started together, to have done it (compiled them into the cache once, not once per measurement); the lists
    making no call start beside ``prepare``'s, a process whose first list makes none too (it is told to go on to
    its call once ``prepare`` is done). Without a missing list that calls, ``prepare`` is not run."""
    from resumerge.machine.memory import baseline

    events = _recorded_processes(monkeypatch)
    real_go = baseline._go
    monkeypatch.setattr(baseline, "_go", lambda child: events.append("go") or real_go(child))
    calls = ("json", "json:dumps:1")  # json.dumps("1"): a call, as warm_kernels("12w,...") is
    baseline.measure_ahead((("csv",), calls, ("csv", *calls)), tmp_path, prepare=(("json:loads:1",), ("csv",)))
    assert events == ['start ["json:loads:1"]', 'start ["csv"]', 'start ["csv", "json", "json:dumps:1"]', "wait",
                      "wait", "go", 'start ["json", "json:dumps:1"]', "wait", "wait"], events
    monkeypatch.setattr(baseline, "_measure", lambda modules: pytest.fail(f"measured again: {modules}"))
    assert all(isinstance(baseline.fresh_baseline(each, tmp_path), int) for each in (("csv",), calls))
    events.clear()
    baseline.measure_ahead((("json",), ("csv", "json")), tmp_path / "none-calls", prepare=(("json:loads:1",),))
    assert events == ['start ["json"]', 'start ["csv", "json"]', "wait", "wait"], events  # nothing calls


def test_a_list_that_begins_another_is_measured_by_that_ones_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's modules, and the run's with its importance pass's after them (the second list begins with the
    first), were measured by two fresh processes, each importing torch (~4.5 CPU s): one process measures both,
    reading its RSS as it reaches the end of each, and each figure is what a process measuring that list alone
    reads (up to the few hundred KB two starts of one differ by)."""
    from resumerge.machine.memory import baseline

    lists = (("json",), ("json", "asyncio"))  # asyncio: ~3 MB more, the readings are taken where each list ends
    alone = [baseline._measure(each) for each in lists]  # each in a process of its own, nothing kept
    events = _recorded_processes(monkeypatch)
    baseline.measure_ahead(lists, tmp_path)
    assert events == ['start ["json", "asyncio"]', "wait"], events
    monkeypatch.setattr(baseline, "_measure", lambda modules: pytest.fail(f"measured again: {modules}"))
    kept = [baseline.fresh_baseline(each, tmp_path) for each in lists]
    assert all(isinstance(figure, int) for figure in [*kept, *alone]), (kept, alone)
    assert all(abs(k - a) <= 512 << 10 for k, a in zip(kept, alone)), (kept, alone)  # type: ignore[operator]
    assert kept[1] - kept[0] > 1 << 20, kept  # type: ignore[operator]


def _named(text: str) -> int:
    found = re.search(r"rerun with --max-memory (\S+) or more", text)
    assert found, text
    return parse_size(found[1])


@linux_only
def test_measure_plan_and_measure_and_check_each_name_one_smallest_budget(tmp_path: Path) -> None:
    """``measure --plan`` named the pass's peak beside this process's reading; ``measure`` refused by a reading 1 %
    higher and by each model in turn, so at the figure ``--plan`` printed it was refused naming another; ``check``
    named a figure of its own reading, a little different at each start. Now each command's work has one figure,
    from one function (memory.budget.pass_budget beside check.needs.settled_held): a byte less is refused naming it,
    it runs at it."""
    pytest.importorskip("transformers")
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=1, hidden=32, intermediate=48, vocab=64)
    a, b = make_model(tmp_path / "a", spec, seed=1), make_model(tmp_path / "b", spec, seed=2)
    config = write_config(tmp_path / "rm.yml", {"merge_method": "regmean", "models": [{"model": str(a)},
                                                {"model": str(b)}], "parameters": {"grams": str(tmp_path / "g")}})
    # Each command a process of its own, as a user's are: a figure is its process's reading at the start (kept per
    # installation, replaced by a higher one), and run in this worker each reading was this worker's, which the
    # commands and tests before had grown (a check's second start read 9 MB more than its first in a full run).
    out = tmp_path / "g"
    planned = cli("measure", config, out, "--plan")
    fits = re.search(r"fits is ([0-9.]+) ([kMG]?B),", planned.stdout)
    assert planned.returncode == 0 and fits, planned.stdout
    smallest = parse_size(fits[1] + fits[2])
    short = cli("measure", config, out, "--max-memory", str(smallest - 1))
    assert short.returncode == 2 and short.stderr.count("\n") == 1, short.stderr
    assert _named(short.stderr) == smallest and not out.exists()
    done = cli("measure", config, out, "--max-memory", str(smallest))
    assert done.returncode == 0, done.stderr

    state = tmp_path / "state"
    first = cli("check", a, "--parent", b, "--state-dir", state, "--max-memory", "1MB", "--json")
    assert first.returncode == 2, first.stderr
    named = _named(first.stderr)
    again = cli("check", a, "--parent", b, "--state-dir", state, "--max-memory", str(named - 1), "--json")
    assert again.returncode == 2 and _named(again.stderr) == named, again.stderr
    checked = cli("check", a, "--parent", b, "--state-dir", state, "--max-memory", str(named), "--json")
    assert checked.returncode in (0, 5, 6), checked.stderr


def _recorded_processes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list that each process started from now on (``start`` and its last argument) and each wait for one
    (``wait``) is appended to."""
    import subprocess

    events: list[str] = []
    real = subprocess.Popen

    class Recorded(real):  # type: ignore[misc,valid-type]
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            events.append(f"start {argv[-1]}")
            super().__init__(argv, **kwargs)

        def communicate(self, *args: object, **kwargs: object) -> tuple[str, str]:
            events.append("wait")
            return super().communicate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return events
