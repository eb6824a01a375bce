"""Bad input to ``resumerge evolve``: one line naming what and where, exit 2, before any weight is read and
without a file written into STORAGE (a STORAGE holding another search is left as it was); a second search in a
STORAGE in use exits 4 naming the first.

Tiny generated models (two layers, width 32); nothing is merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import UsageError

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evolve")
    for i, name in enumerate(("base", "a", "b")):
        make_model(root / name, SPEC, seed=i)
    make_model(root / "wide", ModelSpec(layers=2, hidden=48, intermediate=48, vocab=64), seed=3)
    (root / "texts.txt").write_text("the cat sat on the mat\n")
    return root


def _config(root: Path, **changes: Any) -> dict[str, Any]:
    genome = {"models": [str(root / "a"), str(root / "b")], "merge_method": "ties", "base_model": str(root / "base"),
              "layer_granularity": 1}
    genome.update(changes.pop("genome", {}))
    return {"genome": genome, "tasks": [{"kl": {"parent": str(root / "a"), "texts": str(root / "texts.txt")}}],
            **changes}


def _written(folder: Path, doc: dict[str, Any]) -> Path:
    """``doc`` written as ``folder``'s evolve.yml: its path."""
    config = folder / "evolve.yml"
    config.write_text(yaml.safe_dump(doc))
    return config


CASES = [
    ("benchmark", {"tasks": ["hellaswag"]}, [], "hellaswag is a common benchmark", "tasks[0]"),
    ("popsize", {}, ["--popsize", "1"], "two candidates a generation", "--popsize 1"),
    ("filter", {"genome": {"filters": ["no_such_tensor"]}}, [], "matches no tensor", "genome.filters[0]"),
    ("shapes", {"genome": {"models": ["A", "WIDE"]}}, [], "is not the shape of", "genome.models[1]"),
    ("unknown key", {"genome": {"layer_granularty": 1}}, [], "unknown key 'layer_granularty'", "genome."),
    ("texts", {"tasks": [{"nll": {"texts": "/nonexistent/texts.txt"}}]}, [], "no such file", "tasks[0].nll.texts"),
    ("granularity", {"genome": {"layer_granularity": 3}}, [], "not a multiple of 3", "genome.layer_granularity"),
    ("no base", {"genome": {"base_model": None}}, [], "ties needs a base_model", "genome.base_model"),
    ("sigma0", {}, ["--sigma0", "0"], "first step size", "--sigma0"),
]


@pytest.mark.parametrize(("case", "changes", "flags", "says", "where"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, changes: dict[str, Any],
        flags: list[str], says: str, where: str) -> None:
    doc = _config(root, **changes)
    models = doc["genome"]["models"]
    doc["genome"]["models"] = [str(root / m.lower()) if m in ("A", "WIDE") else m for m in models]
    config = _written(tmp_path, doc)
    store = tmp_path / "store"
    assert main(["evolve", str(config), str(store), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and where in err and len(err.splitlines()) == 1, err
    assert not store.exists()


def test_a_benchmark_task_passes_the_opt_in_and_meets_the_next_refusal(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mmlu_gen.yaml").write_text(  # named as a benchmark; it generates, so the next refusal names it
        f"task: mmlu_gen\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {root / 'rows.jsonl'}}}}}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs: {until: ['x']}\nmetric_list: [{metric: exact_match}]\n")
    (root / "rows.jsonl").write_text('{"q": "a b", "a": "c"}\n')
    config = _written(tmp_path, _config(root, tasks=["mmlu_gen"]))
    argv = ["evolve", str(config), str(tmp_path / "s"), "--task-search-path", str(tasks)]
    assert main(argv) == 2
    assert "mmlu_gen is a common benchmark" in capsys.readouterr().err
    assert main([*argv, "--i-understand-the-depths-of-the-evils-i-am-unleashing"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "task mmlu_gen generates text" in lines[-1] and not (tmp_path / "s").exists(), lines


def test_a_storage_holding_another_search_or_foreign_files_is_refused(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _written(tmp_path, _config(root))
    store = tmp_path / "store"
    store.mkdir()
    (store / "search.json").write_text('{"config": "another", "settings": {}, "size": 4, "layers": 2}')
    before = sorted(p.name for p in store.iterdir())
    assert main(["evolve", str(config), str(store)]) == 2
    err = capsys.readouterr().err
    assert "holds another search" in err and "config" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in store.iterdir()) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["evolve", str(config), str(foreign)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_a_generation_past_max_memory_is_refused_naming_the_largest_popsize_that_fits(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from resumerge import api
    from resumerge.api.evolution import _fits, plan_evolve
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.search import SearchOptions

    config = _written(tmp_path, _config(root))
    store = tmp_path / "store"
    assert main(["evolve", str(config), str(store), "--popsize", "1000", "--max-memory", "1MB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a generation of 1000 candidates holds about" in err and "past max-memory" not in err, err
    assert "past --max-memory 1.00 MB" in err and len(err.splitlines()) == 1 and not store.exists(), err
    found = re.search(r"give --popsize (\d+) \(the largest that fits\)", err)
    assert found is not None, err
    fits = int(found[1])
    assert 2 <= fits < 1000
    planned, plan = plan_evolve(config, SearchOptions(popsize=fits), False, api.plan_merge, StateDir.resolve())
    _fits(planned, plan, "1MB")
    planned, plan = plan_evolve(config, SearchOptions(popsize=fits + 1), False, api.plan_merge, StateDir.resolve())
    with pytest.raises(UsageError, match=f"a generation of {fits + 1} candidates"):
        _fits(planned, plan, "1MB")
    assert main(["evolve", str(config), str(store), "--max-memory", "1kB"]) == 2
    assert "give --max-memory" in capsys.readouterr().err


def test_a_second_search_in_a_storage_in_use_exits_4_naming_the_first(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from resumerge.runs.evolve import storage

    config = _written(tmp_path, _config(root))
    store = tmp_path / "store"
    store.mkdir()
    # The first search holds STORAGE's lock (a flock: a second descriptor of this process conflicts with it)
    with storage.locked(store, "resumerge evolve first.yml store"):
        assert main(["evolve", str(config), str(store), "--max-fevals", "2", "--popsize", "2"]) == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"pid {os.getpid()}: resumerge evolve first.yml store" in err, err
    assert not (store / "evaluations.jsonl").exists() and not (store / "work").exists()  # nothing scored
