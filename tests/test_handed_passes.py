"""GLM-5's layers hand their top-k indices to the next beside the hidden states (its "shared" indexers take them:
resumerge.forward.engine.handed); the one layer pass journals them with each layer for every client, so a killed
``measure`` or ``eval`` of GLM-5 resumes with the same figures. Before, only ``check``'s local pass journaled them:
a resumed measurement or evaluation stopped at layer 3 in one line ("takes what an earlier layer returned beside
its hidden states, which this pass no longer holds"). Killed after layer 2 (of 4), whose top-k indices layer 3
takes. The passes on Ray: tests/test_ray_passes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from newest_families import make_newest_model
from safetensors import safe_open
from support import cli, cli_here, digests, write_config

from resumerge import api
from resumerge.cli.modelgen import write_tokenizer

pytest.importorskip("transformers")

TEXTS = "the cat sat on the mat\nhello world, and a longer line of words than the others\nx y\n"


def glm5(folder: Path, family: str = "glm5", seed: int = 3) -> Path:
    """A tiny GLM-5 (``family`` of tests/newest_families.py) with a tokenizer."""
    write_tokenizer(make_newest_model(folder, family, seed), 128)
    return folder


def regmean_of_glm5(folder: Path) -> tuple[Path, Path]:
    """A RegMean config over two dense GLM-5 models made in ``folder``, and the texts its Grams are measured on."""
    models = [glm5(folder / f"m{i}", "glm5_dense", i) for i in range(2)]
    config = write_config(folder / "rm.yml", {"merge_method": "regmean", "dtype": "float32",
                                              "models": [{"model": str(m)} for m in models],
                                              "parameters": {"grams": "grams"}})
    texts = folder / "texts.txt"
    texts.write_text(TEXTS)
    return config, texts


def carried_in(state: Path, pattern: str) -> list[tuple[str, str]]:
    """(layer, output) of the handed-on values in the one journal file left under ``state``: layer 2's top-k
    indices, which layer 3 takes."""
    (journal,) = list(state.rglob(pattern))
    with safe_open(str(journal), "pt") as opened:
        return sorted({tuple(n.split(".")[3:5]) for n in opened.keys() if n.startswith("carried.")})  # noqa: SIM118


@pytest.mark.slow
def test_a_killed_evaluation_of_glm5_resumes_with_the_same_figures(tmp_path: Path) -> None:
    model, texts = glm5(tmp_path / "glm5"), tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    args = ("eval", model, "--tasks", f"nll:{texts}", "--state-dir", tmp_path / "killed", "--json")
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_eval_layer:3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert carried_in(tmp_path / "killed", "layer-*.safetensors") == [("2", "0")]
    resumed = cli_here(*args)  # unkilled: the CLI's main in this process, reading the killed one's journal
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = api.evaluate(model, f"nll:{texts}", api.Settings(state_dir=tmp_path / "whole"))
    assert json.loads(resumed.stdout)["results"] == whole.to_json()["results"]


@pytest.mark.slow
def test_a_killed_measurement_of_glm5_resumes_with_the_same_grams(tmp_path: Path) -> None:
    config, texts = regmean_of_glm5(tmp_path)
    # the runs not killed: the CLI's main in this process; the killed one a process of its own
    whole = cli_here("measure", config, tmp_path / "whole", "--texts", texts, "--state-dir", tmp_path / "s-whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    args = ("measure", config, tmp_path / "grams", "--texts", texts, "--state-dir", tmp_path / "s")
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_measure_layer:3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert carried_in(tmp_path / "s", "hidden-*.safetensors") == [("2", "0")]
    resumed = cli_here(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for folder in ("", "model-00", "model-01"):
        assert digests(tmp_path / "grams" / folder) == digests(tmp_path / "whole" / folder), folder
