"""A recipe (two stages) whose final output is a hub repo: the repo holds exactly what a local recipe OUT holds (the
recipe record naming the repo), a SIGKILL in the final stage is resumed on a "fresh machine" (state dir,
intermediates and HF cache deleted) from the repo alone, and status, verify, plan and a changed recipe answer
for the repo."""

from __future__ import annotations

import json
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, TIERS, Merge, repo_files, uploads
from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import RunLocations, StateDir
from resumerge.config.settings import RunSettings
from resumerge.errors import InterruptedMerge
from resumerge.merge.engine.reporting import Driving
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME
from resumerge.runs.recipes.plan import default_intermediate_dir
from resumerge.runs.recipes.run import run_recipe
from tests.support import as_on_the_hub, cli

BATCH = ("--commit-every", "2", "--commit-interval", "0.2")


@dataclass(frozen=True)
class Recipe:
    """A two-stage recipe over the hubout models, where its stages go, and the files of its local run."""

    path: Path
    intermediates: Path
    reference: dict[str, bytes]


def _recipe_text(merge: Merge) -> str:
    stage = yaml.safe_load(merge.config.read_text())
    final = {"merge_method": "linear", "models": [{"model": "mid", "parameters": {"weight": 0.7}},
                                                  {"model": stage["models"][0]["model"],
                                                   "parameters": {"weight": 0.3}}]}
    return yaml.safe_dump({"name": "mid", **stage}, sort_keys=False) + "---\n" + yaml.safe_dump(final, sort_keys=False)


@pytest.fixture(scope="module")
def recipe(merge: Merge, tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    root = tmp_path_factory.mktemp("hub-recipe")
    path = root / "recipe.yml"
    path.write_text(_recipe_text(merge))
    out, inter = root / "local-out", root / "intermediates"
    api.run(path, out, settings=api.Settings(state_dir=root / "local-state", stages=api.Stages(intermediate_dir=inter),
                                             output=api.Output(out_shard_size=SHARD)))
    return Recipe(path, inter, as_on_the_hub({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}))


def _same_as_local(files: dict[str, bytes], recipe: Recipe, url: str) -> None:
    """Every file byte for byte as the local run wrote it; the recipe record differs only in naming the repo as
    the final stage's output and in its places: a folder OUT's relative to OUT, the repo's relative to the
    intermediate dir's parent (no machine path in either, issue 95)."""
    assert files.keys() == recipe.reference.keys()
    for name, data in files.items():
        if name != RECIPE_MANIFEST_NAME:
            assert data == recipe.reference[name], name
    assert str(recipe.intermediates.parent) not in files[RECIPE_MANIFEST_NAME].decode()
    ours, local = json.loads(files[RECIPE_MANIFEST_NAME]), json.loads(recipe.reference[RECIPE_MANIFEST_NAME])
    final = next(s for s in ours["stages"] if s["final"])
    assert final["out_dir"] == url and ours["state"] == "done"
    final["out_dir"] = next(s for s in local["stages"] if s["final"])["out_dir"]
    assert ours["intermediate_dir"] == Path(ours["intermediate_dir"]).name  # the dir's name (a resume's own)
    assert local["intermediate_dir"] == f"../{recipe.intermediates.name}"
    for each in (ours, local):
        for stage in each["stages"]:
            if not stage["final"]:
                assert stage["out_dir"] == f"{each['intermediate_dir']}/{stage['name']}"
        del each["intermediate_dir"]
        each["stages"] = [{**stage, "out_dir": None} if not stage["final"] else stage for stage in each["stages"]]
    assert ours == local


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_a_recipe_to_the_hub_equals_a_local_recipe_run(hub: HubWriter, recipe: Recipe, merge: Merge, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    url = "hf://alice/recipe"
    outcome = api.run(recipe.path, url, settings=api.Settings(state_dir=tmp_path / "state",
                                                              stages=api.Stages(intermediate_dir=recipe.intermediates),
                                                              output=api.Output(out_shard_size=SHARD),
                                                              hub=api.Hub(commit_every=3, commit_interval=0.2)))
    assert outcome.target == url
    _same_as_local(repo_files(hub, "alice/recipe"), recipe, url)
    assert hub.private["alice/recipe"] is True and all(n == 1 for n in uploads(hub, "alice/recipe").values())
    assert main(["verify", url, "--json"]) == 0  # no ledger here: the repo's manifest is the record
    assert json.loads(capsys.readouterr().out)["ok"]
    # A changed recipe against this repo is refused before anything is read or written, saying what differs.
    changed = tmp_path / "changed.yml"
    changed.write_text(recipe.path.read_text().replace("weight: 0.7", "weight: 0.6"))
    commits = hub.commits["alice/recipe"]
    assert main(["run", str(changed), url, "--state-dir", str(tmp_path / "state"), "--out-shard-size", SHARD,
                 "--intermediate-dir", str(recipe.intermediates), "-q"]) == 4
    assert "document 2 changed: the merge plan changed" in capsys.readouterr().err
    # Nor may a single merge take the recipe's repo over.
    assert main(["run", str(merge.config), url, "--out-shard-size", SHARD, "-q"]) == 4
    assert "holds the output of a recipe" in capsys.readouterr().err
    assert hub.commits["alice/recipe"] == commits
    # plan names the repo as the final stage's output and sizes its staging.
    assert main(["plan", str(recipe.path), url, "--out-shard-size", SHARD, "--probe-size", "0", "--json",
                 "--max-disk", "1k"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert [(s["out_dir"], s["final"]) for s in doc["stages"]][-1] == (url, True)
    assert any("below the largest output shard" in r for r in doc["reasons"])


def test_killed_in_the_final_stage_resumes_from_the_repo_alone(hub: HubWriter, recipe: Recipe, tmp_path: Path,
                                                               hf_env: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    url, state = "hf://team/killed", tmp_path / "state"
    run = cli("run", recipe.path, url, "--state-dir", state, "--intermediate-dir", recipe.intermediates,
              "--out-shard-size", SHARD, "--quiet", *BATCH, env={"RESUMERGE_KILL_AT": "hub_after_upload:3"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert RECIPE_MANIFEST_NAME in repo_files(hub, "team/killed")  # recorded before the first stage ran
    puts = dict(hub.puts)
    # A fresh machine: no state dir (staging inside it), no intermediates, no HF cache.
    shutil.rmtree(state)
    shutil.rmtree(recipe.intermediates)
    shutil.rmtree(hf_env, ignore_errors=True)
    outcome = api.resume(url, settings=api.Settings(state_dir=state, hub=api.Hub(commit_every=2, commit_interval=0.2)))
    # recomputed where this machine puts a repo's intermediates: the repo names no folder of the first machine
    assert outcome.target == url and (default_intermediate_dir(url, StateDir.resolve(state)) / "mid").is_dir()
    assert not recipe.intermediates.exists()
    _same_as_local(repo_files(hub, "team/killed"), recipe, url)
    sent = {k: v for k, v in hub.puts.items() if k.startswith("team/killed/")}
    assert all(v == 1 for v in sent.values()), f"an object was PUT twice: {sent}"
    assert any(puts.get(k) for k in sent)  # some were sent before the kill, and not again
    # Status from the repo alone (another machine: no ledger, and none of the stages' folders, which the repo does
    # not name), then from this machine's ledgers.
    assert main(["status", url, "--state-dir", str(tmp_path / "elsewhere"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "recipe" and doc["source"] == "manifest" and doc["state"] == "done"
    assert [(s["key"], s["state"]) for s in doc["stages"]] == [("mid", "pending"), ("#2", "done")]
    assert main(["status", url, "--state-dir", str(state), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == "ledger" and doc["stages_done"] == 2 and doc["stages"][-1]["out_dir"] == url


def test_stopped_in_a_named_stage_resumes_on_another_machine_from_the_record(hub: HubWriter, recipe: Recipe,
                                                                            tmp_path: Path, hf_env: Path) -> None:
    url, first, second = "hf://alice/early", tmp_path / "first", tmp_path / "second"
    mid = default_intermediate_dir(url, StateDir.resolve(first)) / "mid"
    with pytest.raises(InterruptedMerge):  # stopped once stage mid has written a shard (no process start needed)
        run_recipe(recipe.path.read_text(), RunLocations.of(url, first), PlanOptions(out_shard_size=20_000),
                   RunSettings(state=StateDir.resolve(first)),
                   Driving(should_stop=lambda: any(mid.glob("model-*.safetensors"))))
    assert set(repo_files(hub, "alice/early")) == {RECIPE_MANIFEST_NAME}
    # Another machine, another state dir: the default intermediate dir (under the first one) is gone with it.
    shutil.rmtree(first)
    shutil.rmtree(hf_env, ignore_errors=True)
    assert api.resume(url, settings=api.Settings(state_dir=second)).target == url
    files = repo_files(hub, "alice/early")
    records = {RECIPE_MANIFEST_NAME, "resumerge-manifest.json"}  # they name where the stages were written
    assert {k: v for k, v in files.items() if k not in records} == \
        {k: v for k, v in recipe.reference.items() if k not in records}
    record = json.loads(files[RECIPE_MANIFEST_NAME])
    assert (default_intermediate_dir(url, StateDir.resolve(second)) / "mid").is_dir()
    assert record["state"] == "done" and record["intermediate_dir"] == mid.parent.name  # no machine's folder
