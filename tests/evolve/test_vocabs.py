"""``evolve``'s ``kl`` objectives with a parent of another vocabulary: each candidate's figure is the one ``resumerge
eval CANDIDATE --tasks kl:PARENT:FILE`` gives its merge written (KL over the tokens both hold, as ``check``
compares them), in the streamed generation, the written candidates' scorer and a search killed mid-generation and
resumed alike; a parent whose vocabulary cannot meet the candidates' is refused in one line, exit 2, before any
weight is read. Before, every such objective was refused ("tokenize differently") and a parent with more rows
failed the genome's shape check.

The search merges a model and a copy whose tokenizer renames "k" to "κ" with ``tokenizer_source: union`` (65
tokens; without union those two are refused as a merge of other tokenizers, so a genome of one tokenizer merges
the first model and a twin of its tokenizer); its parents: the first model (by id: the union extends it), the
renamed one (by token string) and a model of 80 rows (by id: it extends the union's 64 shared tokens). Tiny
generated models (two layers, width 32): one generation of two candidates."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.evolve.test_search import FILES
from tests.support import cli, cli_here

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
OPTIONS: dict[str, Any] = {"max_fevals": 2, "popsize": 2, "random_seed": 3}
PARENTS = ("a", "b", "big")


def _renamed(directory: Path, rename: dict[str, str]) -> Path:
    """``directory``'s tokenizer with its tokens renamed (the same ids)."""
    path = directory / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["model"]["vocab"] = {rename.get(t, t): i for t, i in doc["model"]["vocab"].items()}
    doc["model"]["merges"] = []
    for entry in doc["added_tokens"]:
        entry["content"] = rename.get(entry["content"], entry["content"])
    path.write_text(json.dumps(doc))
    return directory


def _config(root: Path, parents: tuple[str, ...], union: bool = True) -> Path:
    # Without union the genome's models share a's tokenizer (a and its retrained twin "a2"): a merge of a and b,
    # whose row 13 means another token, is refused and sent to tokensurgeon.
    genome: dict[str, Any] = {"models": [str(root / "a"), str(root / ("b" if union else "a2"))],
                              "merge_method": "linear", "layer_granularity": 1}
    if union:
        genome["tokenizer_source"] = "union"
    tasks: list[dict[str, Any]] = [{"kl": {"parent": str(root / p), "texts": str(root / "texts.txt")}}
                                   for p in parents]
    config = root / f"evolve-{'-'.join(parents)}-{union}.yml"
    config.write_text(yaml.safe_dump({"genome": genome, "tasks": [*tasks, {"nll": {"texts": str(root / "texts.txt")},
                                                                            "weight": 0.1}]}))
    return config


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vocabs")
    make_model(root / "a", SPEC, seed=0)
    make_model(root / "a2", SPEC, seed=6)
    _renamed(make_model(root / "b", SPEC, seed=1), {"k": "κ"})
    make_model(root / "big", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=80), seed=2)
    (root / "texts.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    return root


@pytest.fixture(scope="module")
def searched(root: Path) -> tuple[Path, Path]:
    config = _config(root, PARENTS)
    api.evolve(config, root / "store", search=api.Search(**OPTIONS))
    return config, root / "store"


def _rows(store: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]


def test_each_candidates_figure_is_what_eval_gives_its_written_merge(
        root: Path, searched: tuple[Path, Path], tmp_path: Path) -> None:
    _, store = searched
    rows = _rows(store)
    assert len(rows) == 2 and rows[0]["tasks"] != rows[1]["tasks"]
    row = rows[1]  # not the starting genotype (the other's weights are all alike)
    texts = root / "texts.txt"
    merge = tmp_path / "candidate"
    (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
    api.run(tmp_path / "c.yml", merge)
    assert json.loads((merge / "config.json").read_text())["vocab_size"] == 65  # the union's
    names = {f"kl:{p}:texts.txt": f"kl:{root / p}:{texts}" for p in PARENTS}
    report = api.evaluate(merge, list(names.values()), api.Settings(state_dir=tmp_path / "state")).to_json()
    for ours, theirs in names.items():
        assert row["tasks"][ours] == pytest.approx(report["results"][theirs]["kl,none"], rel=1e-6, abs=1e-9)
    how = [report["configs"][names[f"kl:{p}:texts.txt"]]["vocabulary"] for p in PARENTS]
    assert "by id" in how[0] and "by token string" in how[1] and "the parent's 80" in how[2], how


def test_a_genome_of_one_tokenizer_measures_its_parents_of_other_vocabularies_as_eval_does(
        root: Path, tmp_path: Path) -> None:
    # No union: every candidate has a's tokenizer (the genome's models share it), judged before STORAGE is written;
    # b (which has "κ" where a has "k") shares 63 of its 64 tokens, big (80 rows) all 64.
    store = tmp_path / "store"
    api.evolve(_config(root, ("b", "big"), union=False), store, search=api.Search(**OPTIONS))
    row = _rows(store)[1]  # not the starting genotype
    merge = tmp_path / "candidate"
    (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
    api.run(tmp_path / "c.yml", merge)
    texts = root / "texts.txt"
    names = {f"kl:{p}:texts.txt": f"kl:{root / p}:{texts}" for p in ("b", "big")}
    report = api.evaluate(merge, list(names.values()), api.Settings(state_dir=tmp_path / "state")).to_json()
    for ours, theirs in names.items():
        assert row["tasks"][ours] == pytest.approx(report["results"][theirs]["kl,none"], rel=1e-6, abs=1e-9)
    how = [report["configs"][names[f"kl:{p}:texts.txt"]]["vocabulary"] for p in ("b", "big")]
    assert how[0].startswith("63 tokens shared") and "the model's 64, the parent's 80" in how[1], how


def test_the_written_candidates_scorer_gives_the_same_figures(searched: tuple[Path, Path], tmp_path: Path) -> None:
    from resumerge.api.evolution import ApiCalls, SearchAsked, evolve_into
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.search import SearchOptions

    config, store = searched
    options = SearchOptions(OPTIONS["max_fevals"], OPTIONS["popsize"], 1 / 6, OPTIONS["random_seed"])
    evolve_into(SearchAsked(config, tmp_path / "written", options, api.Resources(), StateDir.resolve()),
                ApiCalls(api.run, api.plan_merge, api.open_population, api.evaluate), written=True)
    for ours, theirs in zip(_rows(store), _rows(tmp_path / "written"), strict=True):
        assert ours["config"] == theirs["config"]
        for name, value in theirs["tasks"].items():
            assert ours["tasks"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


@pytest.mark.slow
def test_a_search_killed_mid_generation_resumes_to_the_same_files(searched: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    config, store = searched
    args = ("evolve", config, tmp_path / "killed", "--max-fevals", str(OPTIONS["max_fevals"]), "--popsize",
            str(OPTIONS["popsize"]), "--random-seed", str(OPTIONS["random_seed"]))
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_check_layer:1"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list((tmp_path / "killed").rglob("layer-*.safetensors"))  # the pass's first layer journaled
    done = cli_here(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in FILES:
        assert (tmp_path / "killed" / name).read_bytes() == (store / name).read_bytes(), name


def test_a_parent_whose_vocabulary_cannot_meet_the_candidates_is_one_line_before_any_weight_is_read(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vocab = json.loads((root / "a" / "tokenizer.json").read_text())["model"]["vocab"]
    _renamed(make_model(root / "other", SPEC, seed=3), {t: f"x{t}" for t in vocab})  # no token shared
    _renamed(make_model(root / "noc", SPEC, seed=4), {"c": "ç"})  # lacks "c", which line 1 holds
    make_model(root / "wide", ModelSpec(layers=2, hidden=48, intermediate=48, vocab=80), seed=5)
    cases = [(("other",), False, "task kl:other:texts.txt: the candidates and .*other share no token"),
             (("noc",), False, "task kl:noc:texts.txt: line 1 of texts .*texts.txt holds the token 'c', which "
                               ".*noc lacks"),
             (("wide",), False, r"tasks\[0\].kl.parent: .*wide is not the shape of"),
             # a union tokenizer is built with the candidates: refused by the generation's pass, before its first
             # layer (STORAGE claimed, nothing journaled)
             (("other",), True, "task kl:other:texts.txt: candidate 0 and .*other share no token")]
    for parents, union, says in cases:
        store = tmp_path / f"store-{parents[0]}-{union}"
        assert main(["evolve", str(_config(root, parents, union)), str(store), "--popsize", "2"]) == 2
        # the search's progress lines (a union's refusal comes once the search has begun) aside
        err = "\n".join(x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("evolve: "))
        assert len(err.splitlines()) == 1 and re.search(says, err), err
        if union:
            assert not list(store.rglob("layer-*")) and not (store / "evaluations.jsonl").exists()
        else:
            assert not store.exists()
