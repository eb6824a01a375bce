"""The structure genome (issue 99): a search over a tiny model's layer path, scored from the base's cached hidden
states.

The hand-checkable case: the ``kl`` task's parent is the base with layers 2-3 repeated (written by ``run`` from a
``slices:`` config), so the candidate ``repeat 2-3`` is the parent itself (KL 0) and every other candidate is not.
Its pass ran N − i layers for a block starting at i (the cache's saving); the NLL the search records for a
candidate is what ``eval`` finds on that candidate written with ``run``; run again, the search answers with the same
files; ``status`` shows the front; ``--merge-best`` writes the best shape.

Tiny generated models (six layers, width 32): a scan of 16 single blocks and a beam round, a few seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.support import write_config

SPEC = ModelSpec(layers=6, hidden=32, intermediate=48, vocab=64)
FILES = ("evaluations.jsonl", "front.json", "best.yml", "shapes.json")


def make_structure(root: Path, **genome: Any) -> Path:
    """The base, the parent (the base with layers 2-3 repeated), the texts and the config; returns its path."""
    make_model(root / "base", SPEC, seed=3)
    slices = {"merge_method": "passthrough",
              "slices": [{"sources": [{"model": str(root / "base"), "layer_range": r}]} for r in ([0, 4], [2, 6])]}
    (root / "parent.yml").write_text(yaml.safe_dump(slices))
    if not (root / "parent").exists():
        api.run(root / "parent.yml", root / "parent")
    (root / "a.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    (root / "b.txt").write_text("one two three four five six\nsome other words here too\n")
    doc = {"genome": {"kind": "structure", "model": str(root / "base"), "grow": 50, "beam_width": 2,
                      "beam_depth": 1, "beam_edits": 16, **genome},
           "tasks": [{"kl": {"parent": str(root / "parent"), "texts": str(root / "a.txt")}},
                     {"nll": {"texts": str(root / "a.txt")}, "weight": 0.01}],
           "held_out": [{"nll": {"texts": str(root / "b.txt")}}]}
    return write_config(root / "evolve.yml", doc)


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, api.EvolveOutcome]:
    root = tmp_path_factory.mktemp("structure")
    config = make_structure(root)
    return config, root / "store", api.evolve(config, root / "store")


def _rows(store: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]


def test_repeating_the_parent_s_block_is_best_and_every_other_shape_is_worse(
        searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    _, store, outcome = searched
    rows = _rows(store)
    scan = [r for r in rows if r["phase"] == "scan"]
    # the base, then every block of 1-3 layers (grow 50 % of 6: three layers at most) repeated
    assert [r["shape"] for r in scan[:3]] == ["base", "repeat 0-0", "repeat 0-1"]
    assert len(scan) == 1 + sum(min(3, 6 - i) for i in range(6))
    best = min(rows, key=lambda r: r["objective"])
    assert best["shape"] == "repeat 2-3" and best["path"] == [0, 1, 2, 3, 2, 3, 4, 5]
    assert best["tasks"]["kl:parent:a.txt"] < 1e-6
    assert all(r["tasks"]["kl:parent:a.txt"] > 1e-4 for r in rows if r is not best)
    assert outcome.best.config == best["config"] == yaml.safe_load((store / "best.yml").read_text())
    assert best["config"]["slices"] == [{"sources": [{"model": str(store.parent / "base"), "layer_range": r}]}
                                        for r in ([0, 4], [2, 6])]
    beam = [r for r in rows if r["phase"] == "beam 1"]
    assert beam and all(len(r["edits"]) == 2 for r in beam)


def test_a_beam_child_runs_from_where_it_branches_off_its_parent(
        searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    from resumerge.runs.evolve.layercache import branch, departure

    _, store, _ = searched
    rows = _rows(store)
    paths = {r["shape"]: r["path"] for r in rows}
    beam = [r for r in rows if r["phase"] == "beam 1"]
    shared = 0
    for r in beam:
        off, base = branch(r["path"], paths[r["parent"]]), departure(r["path"])
        assert r["computed"] == len(r["path"]) - max(off, base)
        shared += off > base
    assert shared  # some children add their edit after their parent's: they start past the base's departure


def test_a_block_starting_at_i_costs_n_minus_i_layers(searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    _, store, _ = searched
    for r in _rows(store):
        if r["phase"] == "scan" and r["shape"] != "base":
            (kind, first, after), = r["edits"]
            assert (kind, r["computed"], r["full"]) == ("repeat", 6 - first, 6 + after - first)
    assert _rows(store)[0]["computed"] == 0  # the base: its last hidden states are cached


def test_the_front_holds_held_out_figures_and_status_shows_it(
        searched: tuple[Path, Path, api.EvolveOutcome], capsys: pytest.CaptureFixture[str]) -> None:
    _, store, _ = searched
    front = json.loads((store / "front.json").read_text())
    assert front[0]["shape"] == "base" and front[-1]["shape"] == "repeat 2-3"
    assert [f["layers"] for f in front] == sorted(f["layers"] for f in front)
    assert all(f["held_out"]["nll:b.txt"] > 0 for f in front)
    assert main(["status", str(store)]) == 0
    out = capsys.readouterr().out
    assert "finished" in out and "repeat 2-3" in out and "front" in out


def test_a_candidate_s_figure_is_what_eval_finds_on_it_written_by_run(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path) -> None:
    from resumerge.runs.evolve.layercache import branch, departure

    config, store, _ = searched
    rows = _rows(store)
    paths = {r["shape"]: r["path"] for r in rows}
    child = next(r for r in rows if r["parent"] is not None  # a beam child run from its parent's prefix
                 and branch(r["path"], paths[r["parent"]]) > departure(r["path"]))
    for row in (next(r for r in rows if r["shape"] == "repeat 1-3"), child):
        (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
        api.run(tmp_path / "c.yml", tmp_path / row["shape"])
        report = api.evaluate(tmp_path / row["shape"], [f"nll:{config.parent / 'a.txt'}"],
                              api.Settings(state_dir=tmp_path / "state"))
        (found,) = report.results["results"].values()
        assert found["nll,none"] == pytest.approx(row["tasks"]["nll:a.txt"], abs=1e-6)


def test_asked_again_it_answers_with_the_same_files_and_merge_best_writes_the_shape(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, store, _ = searched
    before = {name: (store / name).read_bytes() for name in FILES}
    assert main(["evolve", str(config), str(store), "--merge-best", str(tmp_path / "best")]) == 0
    assert capsys.readouterr().out.startswith(f"best of {len(_rows(store))} candidates: repeat 2-3 (candidate ")
    assert {name: (store / name).read_bytes() for name in FILES} == before
    written = json.loads((tmp_path / "best" / "config.json").read_text())
    assert written["num_hidden_layers"] == 8


@pytest.mark.parametrize(("genome", "words"), [
    ({"grow": "lots"}, "genome.grow: must be a percentage"),
    ({"repeat": [4, 2]}, "genome.repeat: must be [first, last]"),
    ({"repeat": [1, 9]}, "genome.repeat: layer 9 is past the base's last, 5"),
    ({"pattern": "mirror"}, "genome.pattern: must be rewrite or keep"),
    ({"beam_width": 0}, "genome.beam_width: must be a whole number of 1 or more"),
    ({"grow": 0}, "genome: the genome allows no edit"),
    ({"layers": 3}, "genome.layers: unknown key 'layers'"),
])
def test_a_bad_structure_genome_is_refused_in_one_line(tmp_path: Path, genome: dict[str, Any], words: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = make_structure(tmp_path, **genome)
    assert main(["evolve", str(config), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "store").exists()


def test_under_max_disk_the_cache_keeps_every_other_layer_and_the_figures_stay(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path) -> None:
    # three boundaries' room: the states entering layers 2, 4 and 6 kept; a candidate departing at layer j runs
    # from the kept layer at or below j, and finds the same figures to the bit
    config, store, _ = searched
    room = int(3.5 * (store / "cache" / "states-0001.safetensors").stat().st_size)
    parents = sum(p.stat().st_size for p in (store / "cache" / "parents").glob("*.safetensors"))
    other = tmp_path / "store"
    api.evolve(config, other, api.Settings(resources=api.Resources(max_disk=room + 2 * parents)))
    assert sorted(p.name for p in (other / "cache").glob("states-*")) == [
        "states-0002.safetensors", "states-0004.safetensors", "states-0006.safetensors"]
    for ours, theirs in zip(_rows(other), _rows(store), strict=True):
        assert ours["tasks"] == theirs["tasks"] and ours["shape"] == theirs["shape"]
        if ours["phase"] == "scan" and ours["shape"] != "base":
            (_, first, after), = ours["edits"]
            assert ours["computed"] == 6 - first + after % 2


@pytest.mark.slow
def test_a_structure_search_killed_anywhere_ends_with_the_same_files(
        searched: tuple[Path, Path, api.EvolveOutcome]) -> None:
    from tests.support import cli

    config, store, _ = searched
    killed = store.parent / "killed"
    # in the cache's build (after its second layer), twice inside the scan, in the beam, writing best.yml
    for kill in ("after_check_layer:2", "after_evolve_candidate:3", "after_evolve_candidate:6",
                 "after_evolve_candidate:8", "during_best_write:1"):
        done = cli("evolve", config, killed, env={"RESUMERGE_KILL_AT": kill}, timeout=600)
        assert done.returncode == -9, (kill, done.returncode, done.stderr[-2000:])
    status = api.evolve_status(killed)
    assert status.state == "interrupted" and status.resume_command is not None
    lines = status.lines()
    assert "  base: 6 layers" in "\n".join(lines) and lines[-1].startswith("to continue: resumerge evolve")
    assert main(["evolve", str(config), str(killed)]) == 0
    assert {n: (killed / n).read_bytes() for n in FILES} == {n: (store / n).read_bytes() for n in FILES}


def _hybrid(root: Path, pattern: str) -> Path:
    """A Qwen2 base whose layers alternate sliding (window 3) and full attention, and an nll search of it."""
    if not (root / "hybrid").exists():
        make_model(root / "hybrid", ModelSpec(layers=6, hidden=32, intermediate=48, vocab=64, arch="qwen2"), seed=5)
        doc = json.loads((root / "hybrid" / "config.json").read_text())
        doc.update(use_sliding_window=True, sliding_window=3, max_window_layers=0,
                   layer_types=["sliding_attention", "full_attention"] * 3)
        (root / "hybrid" / "config.json").write_text(json.dumps(doc))
        (root / "long.txt").write_text("the cat sat on the mat and looked at the dog for a long while\n"
                                       "hello world again and again and again until the end\n")
    config = root / f"hybrid-{pattern}.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"kind": "structure", "model": str(root / "hybrid"), "grow": 34, "pattern": pattern,
                   "beam_depth": 0},
        "tasks": [{"nll": {"texts": str(root / "long.txt")}}]}))
    return config


def test_a_hybrid_family_keeps_its_pattern_or_each_layer_keeps_its_type(tmp_path: Path) -> None:
    # keep: only blocks of whole periods (two layers: sliding, full) repeat; rewrite: a single layer repeated too,
    # written with its source's type, and the figure the search found is eval's on that written candidate
    api.evolve(_hybrid(tmp_path, "keep"), tmp_path / "keep")
    assert [r["shape"] for r in _rows(tmp_path / "keep")] == [
        "base", "repeat 0-1", "repeat 1-2", "repeat 2-3", "repeat 3-4", "repeat 4-5"]
    api.evolve(_hybrid(tmp_path, "rewrite"), tmp_path / "rewrite")
    rows = _rows(tmp_path / "rewrite")
    row = next(r for r in rows if r["shape"] == "repeat 2-2")
    (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
    api.run(tmp_path / "c.yml", tmp_path / "c")
    written = json.loads((tmp_path / "c" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention",
                                      "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    report = api.evaluate(tmp_path / "c", [f"nll:{tmp_path / 'long.txt'}"], api.Settings(state_dir=tmp_path / "st"))
    (found,) = report.results["results"].values()
    assert found["nll,none"] == pytest.approx(row["tasks"]["nll:long.txt"], abs=1e-6)


def test_a_surrogate_chooses_the_beam_s_children_and_its_rank_correlation_is_reported(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from scipy.stats import spearmanr

    from resumerge.runs.evolve.shapes.surrogate import _spearman

    config, store, _ = searched
    doc = yaml.safe_load(config.read_text())
    doc["genome"]["surrogate"] = 3
    (tmp_path / "evolve.yml").write_text(yaml.safe_dump(doc))
    api.evolve(tmp_path / "evolve.yml", tmp_path / "store")
    rows = _rows(tmp_path / "store")
    whole = {r["shape"] for r in _rows(store) if r["phase"] == "beam 1"}
    chosen = [r["shape"] for r in rows if r["phase"] == "beam 1"]
    assert len(chosen) == 3 and set(chosen) < whole  # three of the children the whole beam scored
    found = json.loads((tmp_path / "store" / "surrogate.json").read_text())
    scored = len(rows)
    assert (found["trained_on"], found["held_out"]) == ((scored + 1) // 2, scored // 2)
    assert -1 <= found["spearman"] <= 1
    a, b = [3.0, 1.0, 2.0, 2.0, 5.0], [0.3, 0.1, 0.25, 0.2, 0.9]
    assert _spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)


def test_a_base_changed_under_a_killed_search_s_cache_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.support import cli, cli_here

    config = make_structure(tmp_path)
    done = cli("evolve", config, tmp_path / "store", env={"RESUMERGE_KILL_AT": "after_check_layer:3"}, timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = next(p for p in sorted((tmp_path / "base").glob("*.safetensors")) if name in load_file(str(p)))
    tensors = load_file(str(shard))
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    again = cli_here("evolve", config, tmp_path / "store")  # (the kill needs a process; the refusal does not)
    assert again.returncode == 4, again.stderr[-2000:]
    assert "journal holds hidden states computed from the bytes it held then" in again.stderr


def test_edits_make_paths_slices_and_sizes_as_the_genome_bounds_them() -> None:
    from resumerge.runs.evolve.layercache import Borrowed, departure, stride_for
    from resumerge.runs.evolve.shapes.genome import (
        Edit,
        Shape,
        StructureGenome,
        keeps_pattern,
        period,
        shape_config,
        single_edits,
        within,
    )

    skip, twice = Shape((Edit("skip", 2, 4),)), Shape((Edit("repeat", 1, 3), Edit("skip", 4, 5)))
    assert skip.path(6) == [0, 1, 4, 5] and departure(skip.path(6)) == 2 and skip.key == "skip 2-3"
    assert twice.path(6) == [0, 1, 2, 1, 2, 3, 5] and departure(twice.path(6)) == 3
    assert twice.with_edit(Edit("repeat", 2, 4)) is None  # overlaps an edit it has
    mixed = Shape((Edit("repeat", 1, 2, 1, 0.5), Edit("swap", 3, 5, 0, 2.0)))
    assert mixed.key == "repeat 1-1 from 1 ×0.5, swap 3-4 ×2.0"
    assert mixed.path(6) == [0, 1, Borrowed(1, 1, 0.5), 2, Borrowed(0, 3, 2.0), Borrowed(0, 4, 2.0), 5]
    assert Shape.from_json(mixed.to_json()) == mixed
    assert mixed.scaled([1.0, 0.75]).key == "repeat 1-1 from 1, swap 3-4 ×0.75"
    half = [{"filter": "o_proj", "value": 0.5}, {"filter": "down_proj", "value": 0.5}, {"value": 1.0}]
    assert shape_config("m", mixed.path(6), ["o"])["slices"][1:3] == [
        {"sources": [{"model": "o", "layer_range": [1, 2], "parameters": {"scale": half}}]},
        {"sources": [{"model": "m", "layer_range": [2, 3]}]}]
    assert shape_config("m", twice.path(6))["slices"] == [
        {"sources": [{"model": "m", "layer_range": r}]} for r in ([0, 3], [1, 4], [5, 6])]
    genome = StructureGenome("m", grow=20, shrink=40, repeat=(1, 4))
    edits = single_edits(genome, 10)  # at most 2 layers added, 4 dropped, inside layers 1-4
    assert Edit("repeat", 1, 3) in edits and Edit("repeat", 1, 4) not in edits and Edit("skip", 1, 5) in edits
    assert all(e.first >= 1 and e.after <= 5 for e in edits)
    assert within(genome, Shape((Edit("skip", 1, 5),)), 10) and not within(genome, Shape((Edit("skip", 0, 5),)), 10)
    assert not within(genome, Shape((Edit("repeat", 8, 10, 1),)), 10)  # another source's layer would end the path
    assert period(["s", "s", "f"] * 3) == 3 and period(["f"] * 4) == 1 and period(["s", "f", "f"]) == 3
    assert keeps_pattern(["s", "f"] * 3, [0, 1, 2, 3, 2, 3, 4, 5]) and not keeps_pattern(["s", "f"] * 3, [0, 1, 1])
    assert (stride_for(30, 100, None), stride_for(30, 100, 3000), stride_for(30, 100, 1000),
            stride_for(30, 100, 99)) == (1, 1, 3, 31)


def test_a_pass_past_max_memory_is_refused_in_one_line(searched: tuple[Path, Path, api.EvolveOutcome],
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _, _ = searched
    assert main(["evolve", str(config), str(tmp_path / "store"), "--max-memory", "10MB"]) == 2
    err = capsys.readouterr().err
    assert "the structure search's pass needs" in err and "Traceback" not in err
    assert not list((tmp_path / "store" / "cache").glob("states-*"))  # no layer run


def test_options_of_the_other_genome_are_refused_in_one_line(
        searched: tuple[Path, Path, api.EvolveOutcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.evolve.test_search import make_search

    config, _, _ = searched
    assert main(["evolve", str(config), str(tmp_path / "s1"), "--popsize", "4"]) == 2
    assert "CMA-ES's: a structure genome is searched by a scan and a beam" in capsys.readouterr().err
    parameters = make_search(tmp_path)
    assert main(["evolve", str(parameters), str(tmp_path / "s2"), "--max-disk", "1GB"]) == 2
    assert "--max-disk bounds a structure genome's cache" in capsys.readouterr().err
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s2").exists()


def _mixed(root: Path, **genome: Any) -> Path:
    """The base, another model of its family (``other``), a kl parent that is the base with layers 3-4 taken from
    ``other`` at half their output projections (written by ``run`` from a hand-written slices config, mergekit's
    filtered ``scale``), and a search swapping blocks of layers 2-4 for ``other``'s or scaling them."""
    config = make_structure(root)
    make_model(root / "other", SPEC, seed=4)
    half = [{"filter": "o_proj", "value": 0.5}, {"filter": "down_proj", "value": 0.5}, {"value": 1.0}]
    slices = {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "other"), "layer_range": [3, 5], "parameters": {"scale": half}}]},
        {"sources": [{"model": str(root / "base"), "layer_range": [5, 6]}]}]}
    (root / "mixed.yml").write_text(yaml.safe_dump(slices))
    api.run(root / "mixed.yml", root / "mixed")
    doc = yaml.safe_load(config.read_text())
    doc["genome"].update({"grow": 0, "swap": 2, "repeat": [2, 4], "beam_depth": 0, "sources": [str(root / "other")],
                          "scales": [0.5, 1.0], **genome})
    doc["tasks"][0]["kl"]["parent"] = str(root / "mixed")
    (root / "mixed-evolve.yml").write_text(yaml.safe_dump(doc))
    return root / "mixed-evolve.yml"


def test_a_block_from_another_source_at_a_scale_is_found_and_written_as_run_merges_it(tmp_path: Path) -> None:
    # the parent is the base with layers 3-4 of the other model at half their output projections: that swap has
    # KL 0, every other candidate not; each swap runs the N − i layers after its block's first; the config the
    # search writes for a candidate is the one whose merge eval scores as the search did
    config = _mixed(tmp_path)
    outcome = api.evolve(config, tmp_path / "store")
    rows = _rows(tmp_path / "store")
    assert len(rows) == 1 + 5 * 3  # five blocks of 1-2 layers in 2-4, each from the other at 0.5, 1, or halved
    best = min(rows, key=lambda r: r["objective"])
    assert best["shape"] == outcome.shape == "swap 3-4 from 1 ×0.5"
    assert best["path"] == [0, 1, 2, [1, 3, 0.5], [1, 4, 0.5], 5]
    assert best["tasks"]["kl:mixed:a.txt"] < 1e-6
    assert all(r["tasks"]["kl:mixed:a.txt"] > 1e-4 for r in rows if r is not best)
    assert best["config"] == yaml.safe_load((tmp_path / "mixed.yml").read_text())
    for r in rows[1:]:
        assert r["computed"] == 6 - r["edits"][0][1]
    row = next(r for r in rows if r["shape"] == "swap 2-3 ×0.5")  # the base's own layers scaled
    (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
    api.run(tmp_path / "c.yml", tmp_path / "c")
    report = api.evaluate(tmp_path / "c", [f"nll:{tmp_path / 'a.txt'}"], api.Settings(state_dir=tmp_path / "st"))
    (found,) = report.results["results"].values()
    assert found["nll,none"] == pytest.approx(row["tasks"]["nll:a.txt"], abs=1e-6)


def test_a_source_of_another_family_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = make_structure(tmp_path)
    make_model(tmp_path / "wide", ModelSpec(layers=6, hidden=48, intermediate=48, vocab=64), seed=4)
    doc = yaml.safe_load(config.read_text())
    doc["genome"].update(sources=[str(tmp_path / "wide")], swap=1)
    config.write_text(yaml.safe_dump(doc))
    assert main(["evolve", str(config), str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "genome.sources[0]:" in err and "is not of the base's family" in err and "Traceback" not in err
    assert not (tmp_path / "store").exists()


def test_cma_es_over_the_front_s_scales_moves_the_best_toward_the_parent_s_and_resumes_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the parent's block 3-4 is the other model's at half: the scan (scale 1 alone) finds that swap, CMA-ES over its
    # scale improves on it; the front holds the scaled candidate and status shows it; a search whose record lost
    # its last candidates, run again, replays the strategy and ends with the same files
    config = _mixed(tmp_path, scales=[1.0], repeat=[3, 4],
                    scale_search={"evaluations": 8, "sigma0": 0.3})
    store = tmp_path / "store"
    api.evolve(config, store)
    rows = _rows(store)
    scan = [r for r in rows if r["phase"] == "scan"]
    scaled = [r for r in rows if r["phase"] == "scales"]
    assert scaled and all(" ×" in r["shape"] for r in scaled)
    best = min(rows, key=lambda r: r["objective"])
    assert best["phase"] == "scales" and best["objective"] < min(r["objective"] for r in scan)
    assert best["shape"].startswith("swap 3-4 from 1 ×")
    assert best["shape"] in [f["shape"] for f in json.loads((store / "front.json").read_text())]
    assert main(["status", str(store)]) == 0
    assert best["shape"] in capsys.readouterr().out
    before = {name: (store / name).read_bytes() for name in FILES}
    records = json.loads((store / "shapes.json").read_text())
    (store / "shapes.json").write_text(json.dumps(records[:-3]))
    api.evolve(config, store)
    assert {name: (store / name).read_bytes() for name in FILES} == before


def test_lm_eval_tasks_score_a_structure_from_the_cache_as_eval_scores_it_written(tmp_path: Path) -> None:
    # a multiple-choice task searched, a perplexity task held out: each candidate's figures are lm-eval's on the
    # answers of its layer path from the cache, equal to eval's on the candidate written by run
    pytest.importorskip("lm_eval")
    from tests.evaluation.evaltasks import tiny_model, write_tasks

    tiny_model(tmp_path / "base", seed=1, context=64)
    write_tasks(tmp_path)
    config = tmp_path / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"kind": "structure", "model": str(tmp_path / "base"), "grow": 34, "beam_depth": 0},
        "tasks": [{"name": "tiny_mc", "metric": "acc,none"}, {"name": "tiny_ppl", "metric": "word_perplexity,none",
                                                              "weight": 0.001}],
        "held_out": [{"name": "tiny_ppl", "metric": "bits_per_byte,none"}],
        "limit": 4, "apply_chat_template": False}))
    api.evolve(config, tmp_path / "store", task_search_path=tmp_path / "tasks")
    rows = _rows(tmp_path / "store")
    assert [r["shape"] for r in rows] == ["base", "repeat 0-0", "repeat 1-1", "repeat 2-2"]
    front = json.loads((tmp_path / "store" / "front.json").read_text())
    for row in (rows[0], rows[2]):
        (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
        out = tmp_path / f"c{row['candidate']}"
        api.run(tmp_path / "c.yml", out)
        report = api.evaluate(out, ["tiny_mc", "tiny_ppl"], api.Settings(state_dir=tmp_path / "st"),
                              harness=api.Harness(include_path=tmp_path / "tasks", limit=4))
        assert report.metric("tiny_mc", "acc") == row["tasks"]["tiny_mc"]
        assert report.metric("tiny_ppl", "word_perplexity") == pytest.approx(row["tasks"]["tiny_ppl"], abs=1e-6)
        held = next((f["held_out"] for f in front if f["shape"] == row["shape"]), None)
        if held is not None:
            assert report.metric("tiny_ppl", "bits_per_byte") == pytest.approx(held["tiny_ppl"], abs=1e-6)


def test_merge_best_is_written_as_gguf_where_asked_and_a_type_run_refuses_is_refused_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a tiny base with SmolLM2's tokenizer (a vocabulary the GGUF writer builds): --out-type gguf writes the best
    # shape as one GGUF file; a GGUF type run refuses, or an output format without --merge-best, refused before
    # anything is written
    import shutil

    from resumerge.inputs.gguf.header import read_gguf_metadata
    from tests.realmodel import smollm2_folder

    make_model(tmp_path / "base", ModelSpec(layers=6, hidden=32, intermediate=64, vocab=49152), seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, tmp_path / "base" / name)
    (tmp_path / "base" / "special_tokens_map.json").unlink(missing_ok=True)
    (tmp_path / "a.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    config = tmp_path / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"kind": "structure", "model": str(tmp_path / "base"), "grow": 17, "beam_depth": 0},
        "tasks": [{"nll": {"texts": str(tmp_path / "a.txt")}}]}))
    assert main(["evolve", str(config), str(tmp_path / "s"), "--merge-best", str(tmp_path / "b2"),
                 "--out-type", "gguf", "--gguf-type", "q9_z"]) == 2
    assert main(["evolve", str(config), str(tmp_path / "s"), "--out-type", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "--gguf-type q9_z" in err and "say how --merge-best is written" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists() and not (tmp_path / "b2").exists()
    assert main(["evolve", str(config), str(tmp_path / "store"), "--merge-best", str(tmp_path / "best"),
                 "--out-type", "gguf", "--gguf-type", "q8_0"]) == 0
    best = min(_rows(tmp_path / "store"), key=lambda r: (r["objective"], r["layers"], r["shape"]))
    assert read_gguf_metadata(tmp_path / "best" / "model.gguf")["llama.block_count"] == best["layers"]


@pytest.mark.oracle
def test_mergekit_writes_a_filtered_scale_s_slices_as_run_does(tmp_path: Path, mergekit: Any) -> None:
    # the candidate's config as the search writes it (another source's block, its output projections halved),
    # merged by mergekit 0.1.5: the same tensors as run's
    import torch

    from tests.support import output_tensors

    _mixed(tmp_path)
    done = mergekit.run(tmp_path / "mixed.yml", tmp_path / "theirs", "--quiet", "--no-copy-tokenizer")
    assert done.returncode == 0, done.stderr
    ours, theirs = output_tensors(tmp_path / "mixed"), output_tensors(tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    half = "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(ours[half], output_tensors(tmp_path / "other")[half] * 0.5)


def test_a_scaled_block_of_a_bfloat16_base_is_scored_as_run_writes_it(tmp_path: Path) -> None:
    # run writes a scaled block's weights rounded to bfloat16 (0.7: not a power of two); the search rounds them so
    # too, and its figure is eval's on the candidate written by run
    import torch

    bf16 = ModelSpec(layers=6, hidden=32, intermediate=48, vocab=64, dtype=torch.bfloat16)
    make_model(tmp_path / "base", bf16, seed=3)
    make_model(tmp_path / "other", bf16, seed=4)
    (tmp_path / "a.txt").write_text("the cat sat on the mat\nhello world again and again\n")
    config = tmp_path / "evolve.yml"
    config.write_text(yaml.safe_dump({
        "genome": {"kind": "structure", "model": str(tmp_path / "base"), "grow": 0, "swap": 1, "repeat": [3, 3],
                   "sources": [str(tmp_path / "other")], "scales": [0.7], "beam_depth": 0},
        "tasks": [{"nll": {"texts": str(tmp_path / "a.txt")}}]}))
    api.evolve(config, tmp_path / "store")
    rows = _rows(tmp_path / "store")
    assert [r["shape"] for r in rows] == ["base", "swap 3-3 ×0.7", "swap 3-3 from 1 ×0.7"]
    for row in rows[1:]:
        (tmp_path / "c.yml").write_text(yaml.safe_dump(row["config"]))
        out = tmp_path / f"c{row['candidate']}"
        api.run(tmp_path / "c.yml", out)
        report = api.evaluate(out, [f"nll:{tmp_path / 'a.txt'}"], api.Settings(state_dir=tmp_path / "st"))
        (found,) = report.results["results"].values()
        assert found["nll,none"] == pytest.approx(row["tasks"]["nll:a.txt"], abs=1e-6)
