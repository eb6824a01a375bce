"""A whole search on tiny models: two generations of two candidates of a ``ties`` genome over two layer groups, scored
by two ``kl`` tasks (each parent on its own texts) and an ``nll`` task. STORAGE holds the table (JSONL and CSV, one
row per candidate, the objective the weighted sum of its tasks), ``best.yml`` (which ``resumerge run`` and
mergekit-yaml both run), the chart; the first candidate is the starting genotype; ``status`` says where it stands; a
candidate's figure is what ``check`` finds on its written merge; run again, the search answers with the same files;
``--merge-best`` writes the best.

Tiny generated models (two layers, width 32, a byte-level tokenizer): about 15 s for the search on the shared
machine, most of it four merges and twelve forward passes."""

from __future__ import annotations

import csv
import json
import math
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from mergekit_oracle import Mergekit
from support import digests

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
FILES = ("evaluations.jsonl", "evaluations.csv", "best.yml", "objective.png", "state.json")


def make_search(root: Path) -> Path:
    """The models, texts and config of the search; returns the config's path."""
    for i, name in enumerate(("base", "a", "b")):
        make_model(root / name, SPEC, seed=i)
    (root / "a.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    (root / "b.txt").write_text("one two three four five six\nsome other words here too\n")
    doc = {"genome": {"models": [str(root / "a"), str(root / "b")], "merge_method": "ties",
                      "base_model": str(root / "base"), "layer_granularity": 1},
           "tasks": [{"kl": {"parent": str(root / "a"), "texts": str(root / "a.txt")}},
                     {"kl": {"parent": str(root / "b"), "texts": str(root / "b.txt")}, "weight": 0.5},
                     {"nll": {"texts": str(root / "b.txt")}, "weight": 0.1}]}
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump(doc))
    return config


# Two generations of two.
OPTIONS: dict[str, Any] = {"max_fevals": 4, "popsize": 2, "random_seed": 7}


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, api.EvolveOutcome]:
    root = tmp_path_factory.mktemp("search")
    config = make_search(root)
    return config, root / "store", api.evolve(config, root / "store", search=api.Search(**OPTIONS))


def test_the_table_holds_every_candidate_and_the_objective_is_the_weighted_sum(
        searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    _, store, outcome = searched
    rows = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]
    assert [(r["generation"], r["candidate"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    names = ["kl:a:a.txt", "kl:b:b.txt", "nll:b.txt"]
    for row in rows:
        assert list(row["tasks"]) == names and len(row["genotype"]) == 2 * 2 * 2  # groups x models x (w, density)
        t = row["tasks"]
        assert math.isclose(row["objective"], t[names[0]] + 0.5 * t[names[1]] + 0.1 * t[names[2]], rel_tol=1e-12)
        assert row["config"]["merge_method"] == "ties" and len(row["config"]["slices"]) == 2
        assert t[names[0]] > 0 and t[names[2]] > 0
    assert len({r["objective"] for r in rows}) == 4  # four different candidates
    with (store / "evaluations.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [float(r["objective"]) for r in table] == [r["objective"] for r in rows]
    assert json.loads(table[3]["config"]) == rows[3]["config"]
    best = min(rows, key=lambda r: r["objective"])
    assert (outcome.best.generation, outcome.best.number) == (best["generation"], best["candidate"])
    assert outcome.generations == 2
    text = (store / "best.yml").read_text()
    assert yaml.safe_load(text) == best["config"] and text.startswith("# resumerge evolve: the best of 4")
    assert (store / "objective.png").read_bytes().startswith(b"\x89PNG")
    assert not (store / "work").exists() and not (store / "journal").exists()  # every candidate's merge removed


def test_the_first_candidate_is_the_default_parameter_merge_and_the_best_is_no_worse(
        searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    from resumerge.runs.evolve.options import SearchOptions
    from resumerge.runs.evolve.search import plan_search
    from resumerge.runs.evolve.spec import read_spec

    config, store, outcome = searched
    first = json.loads((store / "evaluations.jsonl").read_text().splitlines()[0])
    planned = plan_search(read_spec(config.read_text()), 2, SearchOptions(4, 2, 1 / 6, 7))
    assert first["genotype"] == [0.5, 1.0] * 4 == list(planned.settings.x0)  # mergekit's: weights 1/2, densities 1
    assert first["config"] == planned.config_of(planned.settings.x0)
    assert outcome.best.objective <= first["objective"]


def test_best_yml_runs_under_run_and_mergekit_and_its_figure_is_what_check_finds(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path, mergekit: Mergekit) -> None:
    config, store, outcome = searched
    ours = tmp_path / "ours"
    api.run(store / "best.yml", ours)
    theirs = mergekit.run(str(store / "best.yml"), str(tmp_path / "theirs"))
    assert theirs.returncode == 0, theirs.stderr
    report = api.check(ours, parents=[config.parent / "a"], prompts=config.parent / "a.txt",
                       settings=api.Settings(state_dir=tmp_path / "state"))
    kl = report.models[-1].kl
    assert kl is not None and math.isclose(kl, outcome.best.tasks["kl:a:a.txt"], rel_tol=1e-6)


def test_asked_again_it_answers_with_the_same_files_and_status_says_finished(
        searched: tuple[Path, Path, api.EvolveOutcome], capsys: pytest.CaptureFixture[str]) -> None:
    config, store, outcome = searched
    before = {name: (store / name).read_bytes() for name in FILES}
    again = api.evolve(config, store, search=api.Search(**OPTIONS))
    assert again.best == outcome.best
    assert {name: (store / name).read_bytes() for name in FILES} == before
    assert main(["status", str(store)]) == 0
    out = capsys.readouterr().out
    assert "finished, 4 candidates in 2 generations" in out and f"{outcome.best.objective:.6g}" in out
    status = api.evolve_status(store)
    assert status.finished and status.evaluated == 4 and status.best == outcome.best.objective


def test_status_reaches_a_search_through_the_analyses_table(searched: tuple[Path, Path, api.EvolveOutcome],
                                                            tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # issue 83: api.status did not know a search (resumerge status STORAGE was the CLI's special case)
    _, store, _ = searched
    assert api.status(store) == api.evolve_status(store)
    assert main(["status", str(store), "--json", "--state-dir", str(tmp_path / "elsewhere")]) == 0
    assert json.loads(capsys.readouterr().out) == api.evolve_status(store).to_json()


def test_a_search_given_a_state_dir_names_it_in_the_command_that_continues_it(tmp_path: Path) -> None:
    from resumerge.api.evolution import SearchAsked, evolve_command
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.options import SearchOptions

    def command(state: StateDir) -> list[str]:
        return shlex.split(evolve_command(SearchAsked("c.yml", tmp_path / "s", SearchOptions(4), api.Resources(),
                                                      state)))

    assert command(StateDir.resolve(tmp_path / "st"))[-2:] == ["--state-dir", str(tmp_path / "st")]
    assert "--state-dir" not in command(StateDir.resolve())


def test_merge_best_writes_the_merge_run_writes(searched: tuple[Path, Path, api.EvolveOutcome],
                                                tmp_path: Path) -> None:
    config, store, _ = searched
    out = tmp_path / "best"
    assert main(["evolve", str(config), str(store), "--max-fevals", "4", "--popsize", "2", "--random-seed", "7",
                 "--merge-best", str(out)]) == 0
    reference = tmp_path / "reference"
    api.run(store / "best.yml", reference)
    weights = {k: v for k, v in digests(out).items() if k.endswith(".safetensors")}
    assert weights and weights == {k: v for k, v in digests(reference).items() if k.endswith(".safetensors")}


def test_a_different_seed_in_the_same_storage_is_another_search(
        searched: tuple[Path, Path, api.EvolveOutcome], capsys: pytest.CaptureFixture[str]) -> None:
    config, store, _ = searched
    assert main(["evolve", str(config), str(store), "--max-fevals", "3", "--popsize", "2"]) == 2
    assert "holds another search (its settings differ)" in capsys.readouterr().err


def test_the_streamed_generation_gives_each_candidate_its_written_merges_figures(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path) -> None:
    from resumerge.api.evolution import ApiCalls, SearchAsked, evolve_into
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.options import SearchOptions

    config, store, _ = searched
    written = tmp_path / "written"
    options = SearchOptions(OPTIONS["max_fevals"], OPTIONS["popsize"], 1 / 6, OPTIONS["random_seed"])
    evolve_into(SearchAsked(config, written, options, api.Resources(), StateDir.resolve()),
                ApiCalls(api.run, api.plan_merge, api.open_population, api.evaluate), written=True)
    streamed = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]
    merged = [json.loads(line) for line in (written / "evaluations.jsonl").read_text().splitlines()]
    assert [(r["genotype"], r["config"]) for r in streamed] == [(r["genotype"], r["config"]) for r in merged]
    for ours, theirs in zip(streamed, merged, strict=True):
        for name, value in theirs["tasks"].items():
            assert ours["tasks"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_a_slerp_genome_of_three_models_scores_candidates_reading_different_pairs(tmp_path: Path) -> None:
    from resumerge.runs.evolve.streamed import _models_read

    for i, name in enumerate(("a", "b", "c")):
        make_model(tmp_path / name, SPEC, seed=i)
    (tmp_path / "t.txt").write_text("the cat sat on the mat\n")
    config = tmp_path / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"models": [str(tmp_path / m) for m in ("a", "b", "c")], "merge_method": "slerp",
                   "layer_granularity": 1},
        "tasks": [{"nll": {"texts": str(tmp_path / "t.txt")}}]}))
    api.evolve(config, tmp_path / "store", search=api.Search(max_fevals=6, popsize=6, sigma0=1.0, random_seed=3))
    rows = [json.loads(line) for line in (tmp_path / "store" / "evaluations.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["tasks"]["nll:t.txt"] > 0 for r in rows)
    assert len({_models_read(r["config"]) for r in rows}) > 1  # candidates over other pairs: populations of their own
