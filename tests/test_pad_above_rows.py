"""Models whose config.json sets ``pad_token_id`` above every token the texts use (fine-tunes of Llama 3 set
128004, of Qwen 151643): a pass holds of the input embeddings only the rows its texts use, the ids renumbered to
them, and the whole table's pad index must not follow it there (torch refused it, "Padding_idx must be within
num_embeddings", and every client of that pass crashed). ``check``, ``eval`` and ``evolve`` give such models
exactly the figures of the same weights without a pad id (the pad index changes no forward value), and a
hidden-state MoE gate over them is mergekit-moe's, killed in its forward pass and resumed alike. (``measure``
embeds with the whole table, :meth:`~resumerge.forward.engine.stream.ModelStream.inputs`, where the index is in range.)

Tiny generated Llamas (vocab 64, pad id 60, far more than the distinct tokens of any text here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from tests.evaluation.evaltasks import write_tasks
from tests.moe.models import SEED, oracle, same_bits, tensors, write
from tests.moe.passthread import passes_on_a_thread
from tests.support import cli

pytest.importorskip("transformers")

PAD = 60
TEXTS = "the cat sat on the mat\nhello world again and again\n"


def _models(root: Path, pad: int | None, layers: int = 2) -> Path:
    """Three models (base, a, b) of the same weights whichever ``pad``, under ``root``, with the texts beside."""
    for i, name in enumerate(("base", "a", "b")):
        make_model(root / name, ModelSpec(layers=layers, pad=pad), seed=i)
    (root / "texts.txt").write_text(TEXTS)
    return root


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The models without a pad id (``plain``) and with one above the rows used (``padded``)."""
    base = tmp_path_factory.mktemp("pads")
    found = {"plain": _models(base / "plain", None), "padded": _models(base / "padded", PAD)}
    assert json.loads((found["padded"] / "a" / "config.json").read_text())["pad_token_id"] == PAD
    return found


def _checked(root: Path) -> dict[str, Any]:
    report = api.check(root / "a", base=root / "base", parents=[root / "b"], prompts=root / "texts.txt",
                       settings=api.Settings(state_dir=root / "check-state"))
    return {"verdict": report.verdict, "tokens": report.tokens,
            "models": [{k: v for k, v in vars(m).items() if k != "path"} for m in report.models]}


def test_check_gives_the_figures_of_the_same_weights_without_a_pad_id(roots: dict[str, Path]) -> None:
    assert _checked(roots["padded"]) == _checked(roots["plain"])


@pytest.mark.slow
def test_eval_gives_the_results_of_the_same_weights_without_a_pad_id(roots: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    tasks = write_tasks(tmp_path)
    results = [api.evaluate(roots[n] / "a", ["tiny_mc", "tiny_ppl"], api.Settings(state_dir=tmp_path / n),
                            harness=api.Harness(include_path=tasks)).to_json()["results"] for n in ("padded", "plain")]
    assert results[0] == results[1]


def _searched(root: Path) -> list[dict[str, Any]]:
    doc = {"genome": {"models": [str(root / "a"), str(root / "b")], "merge_method": "linear",
                      "layer_granularity": 1},
           "tasks": [{"kl": {"parent": str(root / "a"), "texts": str(root / "texts.txt")}},
                     {"nll": {"texts": str(root / "texts.txt")}, "weight": 0.1}]}
    config = root / "evolve.yml"
    config.write_text(yaml.safe_dump(doc))
    api.evolve(config, root / "store", search=api.Search(max_fevals=2, popsize=2,
                                                         random_seed=3))  # one generation of two
    rows = [json.loads(line) for line in (root / "store" / "evaluations.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "config" and "time" not in k and "second" not in k} for row in rows]


@pytest.mark.slow
def test_evolve_scores_its_candidates_as_the_same_weights_without_a_pad_id(roots: dict[str, Path]) -> None:
    padded, plain = _searched(roots["padded"]), _searched(roots["plain"])
    assert len(padded) == 2 and padded == plain


@pytest.mark.oracle
@pytest.mark.slow
def test_a_hidden_gate_over_them_is_mergekit_moes_and_a_kill_in_its_pass_resumes_to_it(tmp_path: Path) -> None:
    root = _models(tmp_path / "models", PAD, layers=4)
    config = write(tmp_path / "hidden.yml", {
        "base_model": str(root / "base"), "gate_mode": "hidden",
        "experts": [{"source_model": str(root / "a"), "positive_prompts": ["hello world", "ab cd ef gh"],
                     "negative_prompts": ["xyz"]},
                    {"source_model": str(root / "b"), "positive_prompts": ["Zq rs tu"]}]})
    out, state = tmp_path / "ours", tmp_path / "state"
    with oracle([(config, tmp_path / "mk", ["--random-seed", str(SEED)])]):
        # killed after its pass's second layer (its pass in a process of its own, as a user's run has it)
        killed = cli("run", config, out, "--state-dir", state, "--random-seed", str(SEED), "--quiet",
                     env={"RESUMERGE_KILL_AT": "after_router_layer:2"}, timeout=300)
        assert killed.returncode == -9, killed.stderr
        (work,) = (state / "moe-routers").iterdir()
        assert sorted(p.name for p in work.iterdir()) == ["layer-00000.safetensors", "layer-00001.safetensors"]
        with passes_on_a_thread():  # run again: the pass goes on from its journal (with or without a plan recorded)
            api.run(config, out, settings=api.Settings(state_dir=state, merging=api.Merging(random_seed=SEED)))
    theirs, ours = tensors(tmp_path / "mk"), tensors(out)
    assert sorted(ours) == sorted(theirs)
    assert [t for t in theirs if not same_bits(theirs[t], ours[t])] == []
