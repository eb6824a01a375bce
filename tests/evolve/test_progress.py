"""What a search says while it runs and after (issue 87): a line on stderr per layer of a generation's pass and per
candidate scored, with the best objective so far and the time left (none with ``--quiet``), from the streamed pass
and the written scorer alike, and on resume; exactly ``--max-fevals`` candidates scored, the last generation cut to
what is left, and ``status`` counting the generations so; the best candidate one number in the summary, ``best.yml``,
``evaluations.csv``/``.jsonl`` and ``--json``; a killed search's ``status`` interrupted, with its pid and the command
that continues it.

Tiny generated models (two layers, width 32), a linear genome of one layer group (two numbers) and one ``nll``
task on two short texts: three candidates in two generations of two, a few seconds a search."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import cli

if TYPE_CHECKING:
    from resumerge.runs.evolve.progress import SearchStep
    from resumerge.runs.evolve.status import SearchStatus

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
ARGS = ("--max-fevals", "3", "--popsize", "2", "--random-seed", "5")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("progress")
    for i, name in enumerate(("a", "b")):
        make_model(root / name, SPEC, seed=i)
    (root / "t.txt").write_text("the cat sat on the mat\nhello world again\n")
    path = root / "evolve.yml"
    path.write_text(yaml.safe_dump({"genome": {"models": [str(root / "a"), str(root / "b")], "merge_method": "linear",
                                               "layer_granularity": 2},
                                    "tasks": [{"nll": {"texts": str(root / "t.txt")}}]}))
    return path


def _rows(store: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]


def test_the_search_says_each_layer_and_candidate_on_stderr_and_nothing_with_quiet(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evolve", str(config), str(tmp_path / "store"), *ARGS]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines and all(line.startswith("evolve: ") for line in lines), lines
    assert lines[0] == "evolve: up to 3 evaluations, 2 generation(s)"
    assert "evolve: generation 1 of 2: 2 candidate(s)" in lines and "evolve: generation 2 of 2: 1 candidate(s)" in lines
    layers = [line for line in lines if re.search(r"layer \d of 2; best so far", line)]
    # one line per layer of each generation's streamed pass: two layers, two generations
    assert [re.search(r"layer (\d)", line)[1] for line in layers] == ["1", "2", "1", "2"]  # type: ignore[index]
    assert "generation 2 of 2, candidate 1 of 1: score nll:t.txt (all candidates), layer 2 of 2" in layers[3]
    scored = [line for line in lines if ": objective " in line]
    assert [re.search(r"(\d) of 3 evaluations", line)[1] for line in scored] == ["1", "2", "3"]  # type: ignore[index]
    assert all(" left" in line for line in scored)  # the time left, once this process has scored something
    assert scored[-1].endswith("3 of 3 evaluations, about 0 s left")
    assert "evolve:" not in captured.out  # stdout: the summary alone
    assert main(["evolve", str(config), str(tmp_path / "quiet"), *ARGS, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_exactly_max_fevals_candidates_are_scored_and_status_counts_the_generations_so(
        config: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    steps: list[SearchStep] = []
    seen: list[SearchStatus] = []

    def watch(step: SearchStep) -> None:
        steps.append(step)
        if step.event == "layer" and step.generation == 2:
            seen.append(api.evolve_status(store))  # from another process's point of view: the files alone

    outcome = api.evolve(config, store, search=api.Search(max_fevals=3, popsize=2, random_seed=5), progress=watch)
    assert [(r["generation"], r["candidate"]) for r in _rows(store)] == [(1, 1), (1, 2), (2, 1)]
    assert outcome.generations == 2
    assert {(s.generation, s.generations) for s in steps if s.event != "start"} == {(1, 2), (2, 2)}
    assert [s.evaluated for s in steps if s.event == "scored"] == [1, 2, 3]
    assert seen and all((s.state, s.pid, s.generation, s.generations, s.size, s.evaluated) ==
                        ("running", os.getpid(), 2, 2, 1, 2) for s in seen)
    assert seen[-1].lines()[0].endswith(f"running, generation 2 of 2 (pid {os.getpid()})")
    status = api.evolve_status(store)
    assert status.finished and (status.evaluated, status.generation, status.generations) == (3, 2, 2)
    before = {p.name: p.read_bytes() for p in store.iterdir() if p.is_file() and p.name != "progress.json"}
    api.evolve(config, store, search=api.Search(max_fevals=3, popsize=2,
                                                random_seed=5))  # finished: answered, nothing scored again
    assert {p.name: p.read_bytes() for p in store.iterdir() if p.is_file() and p.name != "progress.json"} == before


def test_the_written_scorer_says_its_merges_and_layers(config: Path, tmp_path: Path) -> None:
    from resumerge.api.evolution import ApiCalls, SearchAsked, evolve_into
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.search import SearchOptions

    steps: list[SearchStep] = []
    asked = SearchAsked(config, tmp_path / "written", SearchOptions(3, 2, 1 / 6, 5), api.Resources(),
                        StateDir.resolve())
    evolve_into(asked, ApiCalls(api.run, api.plan_merge, api.open_population, api.evaluate), written=True,
                progress=steps.append)
    said = [(s.event, s.generation, s.candidates, s.phase, s.layer) for s in steps if s.event in ("phase", "layer")]
    one = [("phase", "merge", None), ("layer", "score nll:t.txt", 0), ("layer", "score nll:t.txt", 1)]
    assert said == [(e, g, (c,), p, layer) for g, c in ((1, 1), (1, 2), (2, 1)) for e, p, layer in one]
    assert [s.objective for s in steps if s.event == "scored"] == [r["objective"] for r in _rows(tmp_path / "written")]


def test_the_best_candidate_has_one_number_everywhere(config: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert main(["evolve", str(config), str(store), *ARGS]) == 0
    summary = re.search(r"generation (\d+), candidate (\d+), objective", capsys.readouterr().out)
    assert summary is not None
    head = re.search(r"\(generation (\d+), candidate (\d+)\)", (store / "best.yml").read_text().splitlines()[0])
    assert head is not None and head.groups() == summary.groups()
    with (store / "evaluations.csv").open() as f:
        table = list(csv.DictReader(f))
    best = min(table, key=lambda r: float(r["objective"]))
    assert (best["generation"], best["candidate"]) == summary.groups()
    row = min(_rows(store), key=lambda r: float(r["objective"]))  # type: ignore[arg-type]
    assert (str(row["generation"]), str(row["candidate"])) == summary.groups()
    assert main(["evolve", str(config), str(store), *ARGS, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (str(printed["generation"]), str(printed["candidate"])) == summary.groups()


def test_a_killed_search_is_interrupted_with_its_pid_and_the_command_that_continues_it(
        config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    killed = cli("evolve", config, store, *ARGS, env={"RESUMERGE_KILL_AT": "after_evolve_candidate:1"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert main(["status", str(store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    command = shlex.join(["resumerge", "evolve", str(config), str(store), *ARGS])
    assert (doc["state"], doc["resume_command"], doc["finished"]) == ("interrupted", command, False)
    assert isinstance(doc["pid"], int) and doc["pid"] != os.getpid() and doc["seconds_left"] is None
    assert (doc["generation"], doc["generations"], doc["evaluated"]) == (1, 2, 1)
    assert main(["status", str(store)]) == 0
    words = capsys.readouterr().out
    assert "interrupted, generation 1 of 2\n" in words and f"to continue: {command}" in words
    assert "time left" not in words
    assert "evolve: generation 1 of 2, candidates 1-2 of 2: score nll:t.txt (all candidates), layer 2 of 2" \
        in killed.stderr  # its progress, said before the kill
    assert main(shlex.split(command)[1:]) == 0  # the command status names finishes it
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("evolve: resuming: 1 of 3 evaluations done, best objective so far ")
    assert sum(": objective " in line for line in lines) == 2  # the other candidate of generation 1, then one
    assert api.evolve_status(store).state == "finished" and len(_rows(store)) == 3
