"""Parameter search, then structure search over its best merge (issue 99: the two genomes combined): the parameter
stage is test_search's (a ``ties`` genome over two tiny models, two generations of two), the structure stage scans
the merged model's single repeated layers from the merged model's cached hidden states. STORAGE holds each stage's
search in a folder of its own and ``best.yml``, the combined recipe ``--merge-best`` writes: its first stage the
parameter search's best, its final merge the structure search's best over it — the figure the search recorded is what
``eval`` finds on it. ``status`` names the stage; bad combinations are refused in one line before any model is read.

Tiny generated models (two layers, width 32): the parameter search's four candidates, one merge, three structure
candidates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.commands import main
from resumerge.runs.evolve.combined import STAGES
from tests.evolve.test_search import OPTIONS, make_search
from tests.support import write_config

FILES = ("best.yml", "parameters.yml", "structure.yml", "parameters/evaluations.jsonl", "parameters/best.yml",
         "structure/evaluations.jsonl", "structure/front.json", "structure/best.yml")
ARGS = ("--max-fevals", str(OPTIONS["max_fevals"]), "--popsize", str(OPTIONS["popsize"]),
        "--random-seed", str(OPTIONS["random_seed"]))


def make_combined(root: Path, **structure: Any) -> Path:
    """test_search's parameter genome and tasks with a structure block; returns the config's path."""
    doc = yaml.safe_load(make_search(root).read_text())
    doc["structure"] = structure or {"grow": 50, "beam_depth": 0,
                                     "held_out": [{"nll": {"texts": str(root / "a.txt")}}]}
    return write_config(root / "combined.yml", doc)


@pytest.fixture(scope="module")
def combined(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, api.EvolveOutcome]:
    root = tmp_path_factory.mktemp("combined")
    config = make_combined(root)
    return config, root / "store", api.evolve(config, root / "store", search=api.Search(**OPTIONS))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_structure_stage_searches_the_parameter_optimum_and_best_yml_is_the_combined_recipe(
        combined: tuple[Path, Path, api.EvolveOutcome], capsys: pytest.CaptureFixture[str]) -> None:
    config, store, outcome = combined
    assert len(_rows(store / "parameters" / "evaluations.jsonl")) == OPTIONS["max_fevals"]
    shapes = _rows(store / "structure" / "evaluations.jsonl")
    assert [r["shape"] for r in shapes] == ["base", "repeat 0-0", "repeat 1-1"]
    assert yaml.safe_load((store / "structure.yml").read_text())["genome"]["model"] == str(store.resolve() / "merged")
    # the structure stage's base is the parameter stage's best, written by run: its candidate 'base' scores as the
    # parameter search scored that best (the streamed pass of an unwritten merge against the cache of the written one)
    tried = _rows(store / "parameters" / "evaluations.jsonl")
    assert shapes[0]["objective"] == pytest.approx(min(r["objective"] for r in tried), abs=1e-6)
    assert [r["computed"] for r in shapes] == [0, 2, 1]  # from the merged model's cache: the layers after the copy
    params, final = yaml.safe_load_all((store / "best.yml").read_text())
    assert params == {"name": "parameters", **yaml.safe_load((store / "parameters" / "best.yml").read_text())}
    best = min(shapes, key=lambda r: (r["objective"], r["layers"]))
    assert outcome.shape == best["shape"] and outcome.best.objective == best["objective"]
    assert {s["model"] for piece in final["slices"] for s in piece["sources"]} == {"parameters"}
    assert [piece["sources"][0]["layer_range"] for piece in final["slices"]] == \
        [piece["sources"][0]["layer_range"] for piece in best["config"]["slices"]]
    status = api.evolve_status(store)
    assert status.finished and status.stage == "structure (2 of 2)"
    assert main(["status", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"combined search in {store}: finished, stage structure (2 of 2)\n"), out
    assert main(["evolve", str(config), str(store), *ARGS]) == 0  # asked again: it answers, the front its stage's
    assert f"the size/score front: {store / 'structure' / 'front.json'}" in capsys.readouterr().out
    assert "the size/score front" in out


def test_merge_best_writes_the_combined_config_and_eval_finds_the_figure_the_search_recorded(
        combined: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path) -> None:
    config, store, _ = combined
    before = {name: (store / name).read_bytes() for name in FILES}
    out = tmp_path / "best"
    assert main(["evolve", str(config), str(store), *ARGS, "--merge-best", str(out)]) == 0
    assert {name: (store / name).read_bytes() for name in FILES} == before  # asked again: the same files
    best = min(_rows(store / "structure" / "evaluations.jsonl"), key=lambda r: (r["objective"], r["layers"]))
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == best["layers"]
    report = api.evaluate(out, [f"nll:{config.parent / 'b.txt'}"], api.Settings(state_dir=tmp_path / "state"))
    (found,) = report.results["results"].values()
    assert found["nll,none"] == pytest.approx(best["tasks"]["nll:b.txt"], abs=1e-6)


@pytest.mark.parametrize(("structure", "words"), [
    ({"model": "x"}, "structure.model: not taken here: its base is the parameter stage's best merge"),
    ({"grow": "lots"}, "structure.grow: must be a percentage"),
    ({"repeat": [0, 5]}, "structure.repeat: layer 5 is past the merge's last, 1"),
    ({"sources": ["x"]}, "structure.sources: not taken here"),
    ({"beam_depth": 0, "layers": 3}, "structure.layers: unknown key 'layers'"),
])
def test_a_bad_combination_is_refused_in_one_line_before_any_model_is_read(
        tmp_path: Path, structure: dict[str, Any], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = make_combined(tmp_path, **structure)
    assert main(["evolve", str(config), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_combined_search_killed_anywhere_ends_with_the_same_files(
        combined: tuple[Path, Path, api.EvolveOutcome]) -> None:
    from tests.support import cli

    config, store, _ = combined
    killed = store.parent / "killed"
    # each counted from its process's start: in the parameter stage (a candidate journaled; its last generation
    # durable), in the merge of its best, in the structure stage's cache and after its first candidate, writing the
    # structure stage's best.yml (the parameter stage's rewritten first), then the combined one
    kills = ("after_evolve_candidate:1", "after_evolve_generation:2", "after_ledger_commit:2",
             "after_check_layer:1", "after_evolve_candidate:1", "during_best_write:2", "during_best_write:3")
    for kill, stage in zip(kills, (0, 0, 1, 2, 2, 2, 2), strict=True):
        done = cli("evolve", config, killed, *ARGS, env={"RESUMERGE_KILL_AT": kill}, timeout=600)
        assert done.returncode == -9, (kill, done.returncode, done.stderr[-2000:])
        status = api.evolve_status(killed)
        assert status.state == "interrupted" and status.stage == STAGES[stage], (kill, status)
        assert status.lines()[0] == f"combined search in {killed}: interrupted, stage {STAGES[stage]}"
        assert status.resume_command is not None and f"evolve {config} {killed}" in status.resume_command
    assert any(p.name.startswith(".best.yml.") for p in killed.iterdir())  # the last kill's: the combined best.yml
    assert main(["evolve", str(config), str(killed), *ARGS]) == 0
    assert {n: (killed / n).read_bytes() for n in FILES} == {
        n: (store / n).read_bytes().replace(str(store).encode(), str(killed).encode()) for n in FILES}
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in store.iterdir())
