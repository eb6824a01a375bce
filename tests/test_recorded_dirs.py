"""Where a run's models are recorded (issue 95: OUT's manifest never holds a machine path): the manifest names a
local model as the config names it (relative as typed), never the folder resumerge resolved, so the same merge of
the same models from two folders writes byte-identical manifests; this machine's folders stay in the state dir's
ledger, and a resume with it (or with OUT's manifest alone) finishes the run. A hub model's case (``org/name@<sha>``,
its commit pinned on a fresh machine) is tested with the stand-in hub: ``tests/hubout/test_hub_dirs.py``."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import cli, cli_here

from resumerge.analyses.check.models import find_models, recorded_models
from resumerge.config.locations import StateDir
from resumerge.merge.store.manifest import MANIFEST_NAME, published_dirs
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME

CONFIG = "merge_method: linear\nmodels:\n  - model: ./a\n    parameters: {weight: 0.5}\n" \
         "  - model: models/b\n    parameters: {weight: 0.5}\ndtype: float32\n"


def _run_in_two_folders(make: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str,
                        state: str) -> None:
    """Models a and b copied into ``tmp_path``'s folders ``one`` and ``two`` (a beside the config ``name`` holding
    ``text``, b under ``models/``), and ``run`` of that config from each folder into ``out`` there, its state dir
    ``state`` (formatted with ``folder=``). The working directory is left at ``two``."""
    a, b = make("a", seed=1), make("b", seed=2)
    for folder in ("one", "two"):
        (tmp_path / folder / "models").mkdir(parents=True)
        shutil.copytree(a, tmp_path / folder / "a")
        shutil.copytree(b, tmp_path / folder / "models" / "b")
        (tmp_path / folder / name).write_text(text)
        monkeypatch.chdir(tmp_path / folder)
        done = cli_here("run", name, "out", "--state-dir", state.format(folder=folder))
        assert done.returncode == 0, done.stderr


def test_two_runs_from_two_folders_write_the_same_manifest_with_no_machine_path(
        make: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_in_two_folders(make, tmp_path, monkeypatch, "config.yml", CONFIG, "state")
    one, two = ((tmp_path / f / "out" / MANIFEST_NAME).read_bytes() for f in ("one", "two"))
    assert one == two
    assert str(tmp_path).encode() not in one
    assert json.loads(one)["model_dirs"] == {"./a": "./a", "models/b": "models/b"}
    # Resumed here with the ledger, and with OUT's manifest alone (another state dir): the models are found again.
    for state in ("state", "fresh"):
        again = cli_here("resume", "out", "--state-dir", state)
        assert again.returncode == 0, again.stderr
    assert (tmp_path / "two" / "out" / MANIFEST_NAME).read_bytes() == one
    # ``check`` run from elsewhere finds the parents where this machine's ledger read them (the manifest alone
    # names them as the config does).
    monkeypatch.chdir(tmp_path)
    found = find_models(tmp_path / "two" / "out", None, (), StateDir.resolve(tmp_path / "two" / "state"))
    assert [Path(m.path) for m in found[1:]] == [tmp_path / "two" / "a", tmp_path / "two" / "models" / "b"]


def test_the_published_form_keeps_no_folder_and_reads_back_the_same() -> None:
    """One place makes what the manifest records of a plan's folders (the ledger's row and a fresh plan both go
    through it); written again from a manifest read back, it is unchanged."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    dirs = {"org/name": f"/home/u/.cache/huggingface/hub/models--org--name/snapshots/{sha}",
            "gpt2@main": f"/c/models--gpt2/snapshots/{sha}",
            "./base+../loras/x": "/work/base", "./base+../loras/x#adapter": "/loras/x"}
    published = published_dirs(dirs)
    assert published == {"org/name": f"org/name@{sha}", "gpt2@main": f"gpt2@{sha}",
                         "./base+../loras/x": "./base", "./base+../loras/x#adapter": "../loras/x"}
    assert published_dirs(published) == published


def test_an_out_finished_with_this_machine_s_folders_in_its_manifest_verifies(
        make: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OUT an earlier resumerge finished holds the ledger's folders as ``model_dirs``: ``verify`` finds it whole
    (the same run, written before the folders were published), and another ``model_dirs`` is still damage."""
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    shutil.copytree(make("a", seed=1), work / "a")
    shutil.copytree(make("b", seed=2), work / "models" / "b")
    (work / "config.yml").write_text(CONFIG)
    monkeypatch.chdir(work)
    assert cli_here("run", "config.yml", "out", "--state-dir", "state").returncode == 0
    manifest = work / "out" / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    for older, code in (({"./a": str(work / "a"), "models/b": str(work / "models" / "b")}, 0),
                        ({"./a": str(work / "a"), "models/b": str(work / "elsewhere")}, 3)):
        manifest.write_text(json.dumps({**doc, "model_dirs": older}, indent=2, sort_keys=True) + "\n")
        checked = cli_here("verify", "out", "--state-dir", "state")
        assert checked.returncode == code, checked.stdout + checked.stderr


def test_a_merge_of_gguf_files_resumes_and_names_its_parents_from_out_s_manifest_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF input is recorded as the config names it, its file (the ledger keeps the file's folder): a killed
    run resumed with another state dir opens each file once (not ``a.gguf/a.gguf``, which a folder's rule made of
    it), and OUT's record names the files themselves as its parents (so ``check`` compares with them)."""
    from ggufmodels import Q, hf_tensors, to_gguf, write_gguf

    parents = [tmp_path / f"p{seed}.gguf" for seed in (1, 2)]
    for seed, path in enumerate(parents, 1):
        write_gguf(path, "qwen2", to_gguf("qwen2", hf_tensors("qwen2", seed=seed)), Q.F32)
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {parents[0]}\n    parameters: {{weight: 0.3}}\n"
                      f"  - model: {parents[1]}\n    parameters: {{weight: 0.7}}\ndtype: float32\n")
    monkeypatch.chdir(tmp_path)
    assert cli_here("run", config, "whole", "--state-dir", "s0", "--out-shard-size", "100KB").returncode == 0
    killed = cli("run", config, "out", "--state-dir", "s1", "--out-shard-size", "100KB",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["model_dirs"] == {
        str(p): str(p) for p in parents}
    resumed = cli_here("resume", "out", "--state-dir", "fresh")
    assert resumed.returncode == 0, resumed.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.safetensors")} == {
        p.name: p.read_bytes() for p in (tmp_path / "whole").glob("*.safetensors")}
    assert recorded_models(tmp_path / "out") == (None, [str(p) for p in parents])


RECIPE = "name: mid\nmerge_method: linear\nmodels:\n  - model: ./a\n    parameters: {weight: 0.5}\n" \
         "  - model: models/b\n    parameters: {weight: 0.5}\ndtype: float32\n---\nmerge_method: linear\n" \
         "models:\n  - model: mid\n    parameters: {weight: 0.7}\n  - model: ./a\n    parameters: {weight: 0.3}\n" \
         "dtype: float32\n"


def test_two_recipe_runs_from_two_folders_write_the_same_records_and_resume_from_out_alone(
        make: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe's record in OUT (``resumerge-recipe.json``) names no machine path either: its models as the config
    names them, the intermediate dir and the stages' outputs relative to OUT; the same recipe of the same models
    from two folders, with two state dirs, writes byte-identical records and manifests. Killed with its first
    stage done and its state dir lost, it resumes from OUT's record alone, reading the stage where it is."""
    _run_in_two_folders(make, tmp_path, monkeypatch, "recipe.yml", RECIPE, "state-{folder}")
    written = {folder: [(tmp_path / folder / "out" / name).read_bytes() for name in (RECIPE_MANIFEST_NAME,
                                                                                     MANIFEST_NAME)]
               for folder in ("one", "two")}
    assert written["one"] == written["two"]
    record = json.loads(written["one"][0])
    assert str(tmp_path).encode() not in written["one"][0] + written["one"][1]
    assert record["model_dirs"] == {"./a": "./a", "models/b": "models/b"}
    assert record["intermediate_dir"] == "../out.intermediates"
    assert [s["out_dir"] for s in record["stages"]] == ["../out.intermediates/mid", "."]
    # The state dir lost once the first stage is done: resume from OUT's record alone, the stage found done.
    monkeypatch.chdir(tmp_path / "two")
    final = {p.name: p.read_bytes() for p in (tmp_path / "two" / "out").glob("*.safetensors")}
    stage = {p: p.stat().st_mtime_ns for p in (tmp_path / "two" / "out.intermediates" / "mid").iterdir()}
    for p in (tmp_path / "two" / "out").iterdir():
        if p.name != RECIPE_MANIFEST_NAME:
            p.unlink()
    shutil.rmtree(tmp_path / "two" / "state-two")
    again = cli_here("resume", "out", "--state-dir", "fresh")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "two" / "out").glob("*.safetensors")} == final
    assert (tmp_path / "two" / "out" / RECIPE_MANIFEST_NAME).read_bytes() == written["one"][0]
    assert {p: p.stat().st_mtime_ns for p in stage} == stage  # the stage verified where it is, not written again
