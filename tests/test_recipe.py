"""Multi-document (mergekit-multi) recipes: planned whole, journaled per stage, resumable anywhere.

The recipe under test has three stages written out of order in the file: ``slerp-pq`` (slerp of two local
models), ``lin`` (linear of ``slerp-pq`` and a model served by the stand-in hub) and the unnamed final merge
(ties of ``lin`` and a local model over the hub model as base). Its outputs must equal running the three
configs one by one; SIGKILLs at kill points and at random moments in every stage, and the loss of the state
dir, must not change a byte, and the hub must never serve a byte twice.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hub.fakehub import FakeHub, files_of, iter_requests
from huggingface_hub import close_session, constants
from support import cli, cli_start, digests

import resumerge
import resumerge.api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import RunLocations, StateDir
from resumerge.config.settings import RunSettings
from resumerge.merge.engine.reporting import Driving
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME
from resumerge.runs.recipes.recipe import load_recipe_text
from resumerge.runs.recipes.view import read_recipe_status

REMOTE = "org/remote"
SHARD = "100k"
SPEC = ModelSpec(layers=4, hidden=64, intermediate=128, vocab=256, shard_bytes=200_000)
# Files that name the stage's inputs (stage names in a recipe, folders when run one by one) or the run itself.
PROVENANCE = {"mergekit_config.yml", "README.md", "resumerge-manifest.json", RECIPE_MANIFEST_NAME}
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Models:
    p: Path
    q: Path
    r: Path
    remote: dict[str, bytes]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("recipe-models")
    p, q, r = (make_model(root / n, SPEC, seed=s) for n, s in (("p", 1), ("q", 2), ("r", 3)))
    return Models(p, q, r, files_of(make_model(root / "remote", SPEC, seed=4)))


@pytest.fixture(scope="module")
def served_hub(models: Models) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.push(REMOTE, models.remote)
    with fake:
        yield fake


def _hub_env(mp: pytest.MonkeyPatch, home: Path, url: str) -> None:
    """A private HF home and the stand-in hub, for this process and the CLI subprocesses it starts."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.delenv(var, raising=False)
    env = {"HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HF_TOKEN_PATH": home / "token", "HF_ENDPOINT": url,
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    for var, value in env.items():
        mp.setenv(var, str(value))
    # huggingface_hub read these at import: patch the module constants for in-process runs.
    for name, value in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN_PATH": str(home / "token"),
                        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"), "HF_HUB_OFFLINE": False,
                        "HF_HUB_DISABLE_XET": True}.items():
        if hasattr(constants, name):
            mp.setattr(constants, name, value)


@pytest.fixture
def hub(served_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The stand-in hub with fresh counters, and a fresh HF cache for this test."""
    _hub_env(monkeypatch, tmp_path / "hf", served_hub.url)
    served_hub.reset_counters()
    yield served_hub
    close_session()


def _docs(m: Models, stage: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The recipe's documents in file order; ``stage`` maps stage names to folders (run one by one)."""
    ref = (stage or {}).get
    return [
        {"name": "slerp-pq", "merge_method": "slerp", "base_model": str(m.p),
         "models": [{"model": str(m.p)}, {"model": str(m.q)}], "parameters": {"t": [0.2, 0.8]}},
        {"merge_method": "ties", "base_model": REMOTE,
         "models": [{"model": ref("lin", "lin"), "parameters": {"weight": 1.0, "density": 0.5}},
                    {"model": str(m.r), "parameters": {"weight": 0.5, "density": 0.7}}]},
        {"name": "lin", "merge_method": "linear",
         "models": [{"model": ref("slerp-pq", "slerp-pq"), "parameters": {"weight": 0.6}},
                    {"model": REMOTE, "parameters": {"weight": 0.4}}]},
    ]


def _recipe_text(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


def _model_files(directory: Path) -> dict[str, str]:
    return {k: v for k, v in digests(directory).items() if k not in PROVENANCE}


@dataclass(frozen=True)
class Reference:
    stages: dict[str, dict[str, str]]  # "slerp-pq", "lin", "final" -> digests of the model files
    served: dict[str, int]  # hub body bytes of one fetch of the remote model


@pytest.fixture(scope="module")
def reference(models: Models, served_hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The three configs run one by one as separate merges, each reading the previous outputs' folders."""
    root = tmp_path_factory.mktemp("recipe-reference")
    dirs = {"slerp-pq": root / "slerp-pq", "lin": root / "lin"}
    docs = _docs(models, {k: str(v) for k, v in dirs.items()})
    with pytest.MonkeyPatch.context() as mp:
        _hub_env(mp, root / "hf", served_hub.url)
        served_hub.reset_counters()
        for name, doc in (("slerp-pq", docs[0]), ("lin", docs[2]), ("final", docs[1])):
            doc = {k: v for k, v in doc.items() if k != "name"}
            cfg = root / f"{name}.yml"
            cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
            out = dirs.get(name, root / "final")
            assert main(["run", str(cfg), str(out), "--state-dir", str(root / "state"), "--out-shard-size", SHARD,
                         "--quiet"]) == 0
        close_session()
    served = served_hub.file_bytes()
    assert served and all(k.startswith(REMOTE) for k in served)
    return Reference({n: _model_files(dirs.get(n, root / "final")) for n in ("slerp-pq", "lin", "final")}, served)


@dataclass(frozen=True)
class Run:
    recipe: Path
    out: Path
    inter: Path
    state: Path

    def args(self, command: str) -> list[str | Path]:
        head: list[str | Path] = ["run", self.recipe, self.out, "--out-shard-size", SHARD] if command == "run" \
            else ["resume", self.out]
        return [*head, "--state-dir", self.state, "--quiet"]


def _setup(tmp_path: Path, models: Models, name: str = "r") -> Run:
    recipe = tmp_path / f"{name}.yml"
    recipe.write_text(_recipe_text(_docs(models)))
    return Run(recipe, tmp_path / f"out-{name}", tmp_path / f"out-{name}.intermediates", tmp_path / f"state-{name}")


def _assert_reference(run: Run, ref: Reference) -> None:
    assert _model_files(run.inter / "slerp-pq") == ref.stages["slerp-pq"]
    assert _model_files(run.inter / "lin") == ref.stages["lin"]
    assert _model_files(run.out) == ref.stages["final"]
    assert main(["verify", str(run.out), "--state-dir", str(run.state)]) == 0


def _committed(run: Run) -> int:
    """Files committed so far in all of the recipe's output dirs (read from their manifests)."""
    total = 0
    for directory in (run.inter / "slerp-pq", run.inter / "lin", run.out):
        try:
            total += len(json.loads((directory / "resumerge-manifest.json").read_text())["committed"])
        except (OSError, ValueError):
            continue
    return total


def _first_unfinished(run: Run) -> str:
    status = read_recipe_status(run.out, StateDir.resolve(run.state))
    return next((s.label for s in status.stages if s.state != "done"), "none")


def test_recipe_output_equals_the_stages_run_one_by_one(tmp_path: Path, models: Models, hub: FakeHub,
                                                        reference: Reference) -> None:
    run = _setup(tmp_path, models)
    assert main([str(a) for a in run.args("run")]) == 0
    _assert_reference(run, reference)
    # The hub model is read by two stages: one metadata resolution and one download for the whole recipe.
    assert hub.file_bytes() == reference.served
    revisions = [r for r in iter_requests(hub, "GET") if r.path.startswith(f"/api/models/{REMOTE}/revision")]
    assert len(revisions) == 1
    # Each stage's mergekit_config.yml is its own document; OUT carries the recipe record.
    assert "merge_method: linear" in (run.inter / "lin" / "mergekit_config.yml").read_text()
    assert "name: slerp-pq" in (run.inter / "slerp-pq" / "mergekit_config.yml").read_text()
    record = json.loads((run.out / RECIPE_MANIFEST_NAME).read_text())
    assert [s["key"] for s in record["stages"]] == ["slerp-pq", "lin", "#2"]
    # OUT's record names the intermediate dir relative to OUT, never this machine's folder (issue 95)
    assert record["state"] == "done" and record["intermediate_dir"] == f"../{run.inter.name}"
    assert str(run.inter.parent) not in (run.out / RECIPE_MANIFEST_NAME).read_text()
    # A second run finds every stage done, re-verifies the final output only, and fetches nothing.
    before = digests(run.out)
    assert main([str(a) for a in run.args("run")]) == 0
    assert digests(run.out) == before
    assert hub.file_bytes() == reference.served


@pytest.mark.slow
def test_kill_points_in_every_stage_then_resume(tmp_path: Path, models: Models, hub: FakeHub,
                                                reference: Reference) -> None:
    """A chain of processes each killed at a kill point, the state dir lost once; the last one finishes."""
    run = _setup(tmp_path, models)
    # Each stage writes 9 shards. Counts restart in every process (stages already done are only verified):
    chain = ["after_rename:1",  # only OUT/resumerge-recipe.json exists yet; then the state dir is lost
             "after_manifest_write:4",  # stage slerp-pq: 4 of 9 shards committed
             "mid_shard_write:8",  # slerp-pq finishes; lin dies inside its 3rd shard
             "during_config_write:2",  # lin's shards finish; it dies writing its mergekit_config.yml
             "after_ledger_commit:9"]  # the final merge's last shard: in its ledger, not yet in its manifest
    kills, hit = 0, []
    for i, point in enumerate(chain):
        done = cli(*run.args("run" if i == 0 else "resume"), env={"RESUMERGE_KILL_AT": point})
        assert done.returncode == -signal.SIGKILL, f"{point} was never reached: {done.stderr}"
        kills += 1
        hit.append(_first_unfinished(run))
        if i == 0:
            assert sorted(p.name for p in run.out.iterdir()) == [RECIPE_MANIFEST_NAME]
            shutil.rmtree(run.state)
    assert hit == ["stage slerp-pq", "stage slerp-pq", "stage lin", "stage lin", "document 2"]
    status = read_recipe_status(run.out, StateDir.resolve(run.state))
    assert status.source == "ledger" and status.state == "interrupted"
    assert main([str(a) for a in run.args("resume")]) == 0
    _assert_reference(run, reference)
    assert hub.file_bytes() == reference.served, "no byte of the hub model may be served twice"
    assert kills == len(chain)


@pytest.mark.slow
def test_random_sigkills_across_stages_then_resume(tmp_path: Path, models: Models, hub: FakeHub,
                                                   reference: Reference) -> None:
    run = _setup(tmp_path, models)
    rng = random.Random(8)
    kills, stages_hit = 0, []
    for attempt in range(4):
        # Each process is killed at a random moment after a random number (6..14) of its own commits: a kill
        # during start-up tests little, and the 48 files of the three stages are reached in four attempts.
        target = _committed(run) + rng.randint(6, 14)
        proc = cli_start(*run.args("run" if attempt == 0 else "resume"))  # forked from the fork server
        deadline = time.monotonic() + 60
        while _committed(run) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        stages_hit.append(_first_unfinished(run))
        if attempt == 1:
            shutil.rmtree(run.state)  # a runtime reset: only OUT and the intermediate dir survive
    assert main([str(a) for a in run.args("resume")]) == 0
    _assert_reference(run, reference)
    assert hub.file_bytes() == reference.served
    assert kills >= 3, "the recipe finished before it could be killed three times"
    print(f"random SIGKILLs: {kills}, interrupted in: {stages_hit}")


def _linear(*weighted: tuple[object, float], name: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name} if name else {}
    doc["merge_method"] = "linear"
    doc["models"] = [{"model": str(model), "parameters": {"weight": w}} for model, w in weighted]
    return doc


def _local_recipe(m: Models, *, weight: float = 0.6) -> str:
    return _recipe_text([_linear((m.p, 0.5), (m.q, 0.5), name="a"), _linear(("a", weight), (m.r, 0.4), name="b"),
                         {"merge_method": "passthrough", "models": [{"model": "b"}]}])


def test_status_and_edited_recipe_refused_while_unfinished(tmp_path: Path, models: Models,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from resumerge.errors import InterruptedMerge
    from resumerge.runs.recipes.run import run_recipe

    out, state = tmp_path / "out", tmp_path / "state"
    b_manifest = tmp_path / "out.intermediates" / "b" / "resumerge-manifest.json"

    def b_has_three_shards() -> bool:  # a SIGINT, arriving while stage b writes its 4th shard
        try:
            return len(json.loads(b_manifest.read_text())["committed"]) >= 3
        except (OSError, ValueError):
            return False

    with pytest.raises(InterruptedMerge) as stopped:
        run_recipe(_local_recipe(models), RunLocations.of(out, state), PlanOptions(out_shard_size=100_000),
                   RunSettings(state=StateDir.resolve(state)), Driving(should_stop=b_has_three_shards))
    # The exact command that continues from the ledgers in the state dir (not one that rebuilds them).
    assert stopped.value.resume_command == f"resumerge resume {out} --state-dir {state}"
    assert main(["status", str(out), "--state-dir", str(state), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [(s["label"], s["state"]) for s in status["stages"]] == [
        ("stage a", "done"), ("stage b", "interrupted"), ("document 3", "pending")]
    committed = len(json.loads(b_manifest.read_text())["committed"])
    assert status["stages_done"] == 1 and status["current"]["shards_done"] == committed >= 3
    assert status["current"]["out_dir"] == str(b_manifest.parent)
    assert status["resume_command"].startswith(f"resumerge resume {out}")
    assert main(["status", str(out), "--state-dir", str(state)]) == 0
    text = capsys.readouterr().out
    assert "stage b" in text and "interrupted" in text and "1 of 3 stages done" in text

    edited = tmp_path / "edited.yml"
    edited.write_text(_local_recipe(models, weight=0.65))
    assert main(["run", str(edited), str(out), "--state-dir", str(state), "--out-shard-size", SHARD, "-q"]) == 4
    err = capsys.readouterr().err
    assert "stage b changed" in err and "stage a" not in err.split("stage b changed")[0]
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert read_recipe_status(out, StateDir.resolve(state)).state == "done"


def test_changed_input_refused_on_resume_naming_the_stage(tmp_path: Path, make: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    p, q = make("p", seed=1, **_small()), make("q", seed=2, **_small())
    recipe, out, state = tmp_path / "c.yml", tmp_path / "out", tmp_path / "state"
    recipe.write_text(_recipe_text([_linear((p, 0.5), (q, 0.5), name="first"), _linear(("first", 0.5), (q, 0.5))]))
    assert main(["run", str(recipe), str(out), "--state-dir", str(state), "-q", "--out-shard-size", "20k"]) == 0
    make("p", seed=9, **_small())  # the first stage's input is re-generated with other weights
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 4
    err = capsys.readouterr().err
    assert "stage first changed: input file" in err and "so did document 2" in err


def _small() -> dict[str, Any]:
    return {"layers": 2, "hidden": 32, "intermediate": 48, "vocab": 64, "shard_bytes": 20_000}


BAD_RECIPES: list[tuple[str, str, str]] = [
    # (id, recipe text with {p} {q} placeholders, expected text of the one-line error)
    ("duplicate-name",
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nname: a\nmerge_method: passthrough\nmodels: [{q}]\n"
     "---\nmerge_method: passthrough\nmodels: [a]\n",
     "[document 2] name: duplicate stage name 'a' (documents 1 and 2)"),
    ("two-unnamed",
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: passthrough\nmodels: [a]\n---\n"
     "merge_method: passthrough\nmodels: [{q}]\n",
     "[document 3]: more than one unnamed (final) merge: documents 2 and 3"),
    ("cycle",
     "name: a\nmerge_method: linear\nmodels: [{{model: b, parameters: {{weight: 1}}}}]\n---\nname: b\n"
     "merge_method: linear\nmodels: [{{model: a, parameters: {{weight: 1}}}}]\n---\nmerge_method: passthrough\n"
     "models: [b]\n",
     "[stage a] models[0].model: stages form a cycle: a -> b -> a"),
    ("unknown-reference",
     "name: slerp-ab\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: passthrough\nmodels: [slerp-abb]\n",
     "[document 2] models[0].model: 'slerp-abb' is not a stage of this recipe"),
    ("missing-folder",
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: linear\n"
     "models: [{{model: a, parameters: {{weight: 1}}}}, {{model: ./no/such/model, parameters: {{weight: 1}}}}]\n",
     "[document 2] models[1].model"),
    ("bad-document",
     "name: a\nmerge_method: dare-ties\nmodels: [{p}]\n---\nmerge_method: passthrough\nmodels: [a]\n",
     "[stage a] merge_method: Unimplemented merge method 'dare-ties'"),
    ("later-stage-layer-range",  # needs stage a's planned output: 4 layers, so [0, 6] is past its end
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: passthrough\n"
     "slices: [{{sources: [{{model: a, layer_range: [0, 6]}}]}}]\n",
     "[document 2] slices[0].sources[0].layer_range: layer_range [0, 6] is past the end of a, which has 4 layers"),
    ("bad-name",
     "name: ../escape\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: passthrough\nmodels: [{q}]\n",
     "[document 1] name: stage name '../escape' must not start with '.'"),
    ("stage-revision",
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nmerge_method: passthrough\nmodels: [a@main]\n",
     "[document 2] models[0].model: the reference to stage 'a' has a revision (@main)"),
    ("two-finals",
     "name: a\nmerge_method: passthrough\nmodels: [{p}]\n---\nname: b\nmerge_method: passthrough\nmodels: [{q}]\n",
     "the recipe has 2 final merges (stages no other stage reads): a, b"),
]


@pytest.mark.parametrize(("case", "text", "expected"), BAD_RECIPES, ids=[c[0] for c in BAD_RECIPES])
def test_invalid_recipe_is_exit_2_and_writes_nothing(case: str, text: str, expected: str, tmp_path: Path,
                                                     models: Models, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "bad.yml"
    recipe.write_text(text.format(p=models.p, q=models.q))
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(recipe), str(out), "--state-dir", str(state), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yml"], "nothing may be written"


def test_recipe_parsing_orders_stages_and_keeps_each_documents_text() -> None:
    text = ("# final first\nmerge_method: passthrough\nmodels: [b]\n--- # a comment\nname: b\nmerge_method: linear\n"
            "models:\n  - model: a\n    parameters: {weight: 1}\n...\n---\nname: a\nmerge_method: passthrough\n"
            "models: [x/y]\n")
    recipe = load_recipe_text(text)
    assert [s.key for s in recipe.stages] == ["a", "b", "#1"]
    assert recipe.final.document == 1 and recipe.stage("b").needs == ("a",)
    assert recipe.stage("b").text == "# a comment\nname: b\nmerge_method: linear\nmodels:\n  - model: a\n" \
                                     "    parameters: {weight: 1}\n"
    assert recipe.final.text == "# final first\nmerge_method: passthrough\nmodels: [b]\n"
    example = load_recipe_text((ROOT / "configs" / "recipe-three-stage.yml").read_text())
    assert [s.label for s in example.stages] == ["stage chat-code", "stage chat-code-math", "document 3"]


def test_cleanup_intermediates_deletes_only_stage_files_and_rebuilds_when_needed(
        tmp_path: Path, models: Models, capsys: pytest.CaptureFixture[str]) -> None:
    recipe, out, state = tmp_path / "local.yml", tmp_path / "out", tmp_path / "state"
    recipe.write_text(_local_recipe(models))
    args = ["--state-dir", str(state), "--quiet"]
    # The Python API takes recipes too.
    outcome = resumerge.run(recipe, out, settings=resumerge.Settings(state_dir=state,
                                                                     output=resumerge.Output(out_shard_size=SHARD)))
    assert outcome.out_dir == out and outcome.plan.method == "passthrough"
    assert resumerge.api.recipe_status(out, resumerge.api.Settings(state_dir=state)).stages_done == 3
    kept = _model_files(out)
    assert (tmp_path / "out.intermediates" / "b" / "model.safetensors.index.json").is_file()

    clean, inter = tmp_path / "clean", tmp_path / "work"
    inter.mkdir()
    (inter / "notes.txt").write_text("mine")
    assert main(["run", str(recipe), str(clean), "--intermediate-dir", str(inter), "--out-shard-size", SHARD,
                 "--cleanup-intermediates", *args]) == 0
    assert _model_files(clean) == kept
    assert sorted(p.name for p in inter.iterdir()) == ["notes.txt"], "only resumerge's files are deleted"
    probe = ("import sys, io, json, contextlib\nfrom resumerge.cli.commands import main\nbuf = io.StringIO()\n"
             "with contextlib.redirect_stdout(buf):\n"
             f"    code = main(['status', {str(clean)!r}, '--state-dir', {str(state)!r}, '--json'])\n"
             "heavy = [m for m in ('torch', 'sqlite_utils', 'safetensors', 'rich') if m in sys.modules]\n"
             "print(json.dumps({'code': code, 'heavy': heavy, 'status': json.loads(buf.getvalue())}))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    probed = json.loads(done.stdout)
    assert probed["code"] == 0 and probed["heavy"] == [], "recipe status must stay off the heavy imports"
    status = probed["status"]
    assert status["state"] == "done" and status["intermediates"] == "deleted"
    assert [s["state"] for s in status["stages"]] == ["deleted", "deleted", "done"]
    # Nothing to do on resume: the final output is verified, the deleted stages are not rebuilt.
    assert main(["resume", str(clean), *args]) == 0
    assert sorted(p.name for p in inter.iterdir()) == ["notes.txt"]
    # A damaged final shard needs its inputs again: they are rebuilt, the shard repaired, and deleted again.
    shard = clean / "model-00004-of-00009.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["resume", str(clean), *args]) == 0
    assert _model_files(clean) == kept
    assert sorted(p.name for p in inter.iterdir()) == ["notes.txt"]


def test_single_config_flags_and_outputs_stay_apart(tmp_path: Path, models: Models,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    single = tmp_path / "one.yml"
    single.write_text(yaml.safe_dump({"merge_method": "passthrough", "models": [str(models.p)]}))
    assert main(["run", str(single), str(tmp_path / "o"), "--cleanup-intermediates", "-q"]) == 2
    assert "--cleanup-intermediates applies to recipes only" in capsys.readouterr().err
    recipe = tmp_path / "local.yml"
    recipe.write_text(_local_recipe(models))
    inside = tmp_path / "out" / "stages"
    assert main(["run", str(recipe), str(tmp_path / "out"), "--intermediate-dir", str(inside), "-q"]) == 2
    assert "would overlap OUT" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_out_left_by_a_kill_inside_the_first_manifest_write_is_resumable(tmp_path: Path, models: Models) -> None:
    """A process killed between writing the first manifest's temp file and renaming it leaves only that temp file
    (and, for a recipe's final stage, the recipe record): OUT is still resumerge's, and the leftover is deleted."""
    single = tmp_path / "one.yml"
    single.write_text(yaml.safe_dump({"merge_method": "passthrough", "models": [str(models.p)]}))
    out = tmp_path / "out"
    out.mkdir()
    (out / ".resumerge-manifest.json.0123456789ab.part").write_text('{"format": 1')
    assert main(["run", str(single), str(out), "-q"]) == 0
    assert not list(out.glob(".*")) and (out / "resumerge-manifest.json").is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / ".resumerge-manifest.json.part").write_text("not ours: no random token")
    assert main(["run", str(single), str(foreign), "-q"]) == 4


def test_a_live_display_restarts_for_every_stage(tmp_path: Path, models: Models) -> None:
    from resumerge.cli.render import ProgressReporter
    from resumerge.runs.recipes.run import run_recipe

    stream = io.StringIO()
    reporter = ProgressReporter(mode="live", stream=stream, width=100)
    outcome = run_recipe(_local_recipe(models), RunLocations.of(tmp_path / "out", tmp_path / "state"),
                         PlanOptions(), RunSettings(state=StateDir.resolve(tmp_path / "state")),
                         Driving(lambda: False, reporter))
    reporter.close()
    assert [s.action for s in outcome.stages] == ["merged", "merged", "merged"]
    shown = stream.getvalue()
    assert all(f"{label} ({i}/3): merging into" in shown
               for i, label in enumerate(("stage a", "stage b", "document 3"), start=1))


def test_plan_estimates_every_stage_and_their_shared_disk_writing_nothing(tmp_path: Path, models: Models) -> None:
    from resumerge.runs.recipes.estimate import estimate_recipe
    from resumerge.runs.recipes.run import run_recipe

    text = _local_recipe(models)
    (tmp_path / "recipe.yml").write_text(text)
    out = tmp_path / "out"
    done = cli("plan", tmp_path / "recipe.yml", out, "--json", "--probe-size", "0")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["recipe"] and doc["fits"]
    assert [s["stage"] for s in doc["stages"]] == ["stage a", "stage b", "document 3"]
    assert [s["final"] for s in doc["stages"]] == [False, False, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yml"]  # plan writes nothing

    state = tmp_path / "state"
    run_recipe(text, RunLocations.of(out, state), PlanOptions(), RunSettings(state=StateDir.resolve(state)))
    for stage in doc["stages"]:
        # The recipe's own record in OUT belongs to no stage (a few KB).
        written = sum(f.stat().st_size for f in Path(stage["out_dir"]).iterdir()
                      if f.is_file() and f.name != RECIPE_MANIFEST_NAME)
        assert stage["estimate"]["output"]["total_bytes"] == written, stage["stage"]

    # Each stage output fits on its own, but not all of them together: only the shared check can say so.
    totals = [s["estimate"]["output"]["total_bytes"] for s in doc["stages"]]
    free = sum(totals) - 1
    short = estimate_recipe(text, PlanOptions(), RunSettings(), out_dir=tmp_path / "out2", probe_bytes=0,
                            disk_free=lambda path: free)
    assert not short.fits and "need" in short.reasons[-1] and "--intermediate-dir" in short.reasons[-1]
    assert main(["plan", str(tmp_path / "recipe.yml")]) == 2  # OUT is needed to place the stages


def test_a_stage_ledger_killed_while_being_created_reads_as_not_started(tmp_path: Path) -> None:
    # A SIGKILL between creating ledger.db and committing its schema leaves a file without tables: the stage has
    # committed nothing (its manifest comes first), so its status is "no record", not an unreadable-ledger error.
    from resumerge.config.locations import run_dir
    from resumerge.runs.recipes.view import stage_record

    out, state = tmp_path / "stage", tmp_path / "state"
    out.mkdir()
    ledger = run_dir(out, state) / "ledger.db"
    ledger.parent.mkdir(parents=True)
    sqlite3.connect(ledger).close()
    assert ledger.exists() and stage_record(out, StateDir.resolve(state)) is None
