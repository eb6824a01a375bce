"""A cross-tokenizer merge as one resumable command: a mergekit-multi recipe whose first stage transplants (a
``tokensurgeon:`` document) and whose final merge reads that stage; a kill in either stage resumes to the bytes of
an uninterrupted run; a transplant stage that reads a stage, or names an unknown option, is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import cli, digests

from transplant.pairs import make_pair

RECIPE = """\
name: donor-as-model
tokensurgeon:
  model: {donor}
  donor: {model}
  k: 8
  batch_size: 16
---
merge_method: linear
base_model: {model}
models:
  - model: {model}
    parameters: {{weight: 0.5}}
  - model: donor-as-model
    parameters: {{weight: 0.5}}
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """(the recipe, the files of its uninterrupted run: OUT's, the transplant stage's)."""
    root = tmp_path_factory.mktemp("recipe")
    model, donor = make_pair(root, model_hidden=48, donor_hidden=48)
    path = root / "recipe.yml"
    path.write_text(RECIPE.format(model=model, donor=donor))
    out = root / "out"
    done = cli("run", path, out, "--state-dir", root / "state", "-q", timeout=600)
    assert done.returncode == 0, done.stderr
    return path, _files(out), _files(Path(f"{out}.intermediates") / "donor-as-model")


def _files(folder: Path) -> dict[str, str]:
    return {n: d for n, d in digests(folder).items() if not n.startswith("resumerge-")}


@pytest.mark.parametrize("point", ["after_surgery_batch:5", "during_config_write:2"])
def test_a_kill_in_either_stage_resumes_to_the_same_bytes(recipe: tuple[Path, dict[str, str], dict[str, str]],
                                                          tmp_path: Path, point: str) -> None:
    path, reference, stage = recipe
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", path, out, "--state-dir", state, "-q", env={"RESUMERGE_KILL_AT": point}, timeout=600)
    assert killed.returncode == -9, f"{point} was never reached: {killed.stderr}"
    resumed = cli("resume", out, "--state-dir", state, "-q", timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _files(out) == reference
    assert _files(Path(f"{out}.intermediates") / "donor-as-model") == stage
    assert not list(state.rglob("*.rows")), "the transplant's kept batches outlive its stage"


def test_the_transplanted_stage_has_models_tokenizer(recipe: tuple[Path, dict[str, str], dict[str, str]]) -> None:
    path, _, stage = recipe
    model = Path(path.read_text().split("donor: ")[1].split("\n")[0])
    assert stage["tokenizer.json"] == digests(model)["tokenizer.json"]
    assert "tokensurgeon.json" in stage and "model.safetensors" in stage


@pytest.mark.parametrize(("body", "said"), [
    ("  model: first\n  donor: {model}\n", "a tokensurgeon stage reads models, not stages"),
    ("  model: {donor}\n  donor: {model}\n  atoms: 3\n", "unknown tokensurgeon option 'atoms'"),
])
def test_a_bad_transplant_stage_is_one_line_exit_2(recipe: tuple[Path, dict[str, str], dict[str, str]],
                                                   tmp_path: Path, body: str, said: str) -> None:
    path = recipe[0]
    text = path.read_text()
    model = text.split("donor: ")[1].split("\n")[0]
    donor = text.split("model: ")[1].split("\n")[0]
    bad = tmp_path / "bad.yml"
    bad.write_text("name: first\nmerge_method: passthrough\nmodels:\n  - model: " + model + "\n---\n"
                   "name: second\ntokensurgeon:\n" + body.format(model=model, donor=donor) + "---\n"
                   "merge_method: passthrough\nmodels:\n  - model: second\n")
    ran = cli("run", bad, tmp_path / "out", "--state-dir", tmp_path / "state")
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], ran.stderr
    assert not (tmp_path / "out").exists()
