"""One contract for every kind of run (:data:`resumerge.api.kinds.KINDS`): planned, run, killed by a real SIGKILL at
a kill point, resumed to the uninterrupted run's bytes, and reported by ``status`` as that kind with its own
details; the same for a run recorded by the version before runs recorded their kind (its ledger without the
column). A new kind gets the whole contract by adding one row to :data:`CASES`."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import FAMILIES, make_family_model
from support import cli, digests, linear_config, write_config

from resumerge import api
from resumerge.api.kinds import KINDS
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import LEDGER_NAME

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)


@dataclass(frozen=True)
class Case:
    """One kind of run: ``config`` writes its input under a folder and returns the CLI arguments that run it into
    OUT (``{out}`` and ``{state}`` filled in); killed at ``kill_at``; ``said`` is what its status adds (a
    substring of ``resumerge status``), ``details`` the keys its ``status --json`` fills."""

    kind: str
    config: Callable[[Path], list[str]]
    kill_at: str
    said: str = ""
    details: tuple[str, ...] = ()


def _models(root: Path, count: int) -> list[Path]:
    return [make_model(root / f"m{i}", SPEC, seed=20 + i) if not (root / f"m{i}").exists() else root / f"m{i}"
            for i in range(count)]


def _merge(root: Path) -> list[str]:
    a, b = _models(root, 2)
    return ["run", str(write_config(root / "merge.yml", linear_config(a, b))), "{out}", "--out-shard-size", "10k"]


def _recipe(root: Path) -> list[str]:
    a, b, c = _models(root, 3)

    def linear(*weighted: tuple[object, float]) -> dict[str, Any]:
        models = [{"model": str(m), "parameters": {"weight": w}} for m, w in weighted]
        return {"merge_method": "linear", "models": models}

    docs = [{"name": "mid", **linear((a, 0.5), (b, 0.5))}, linear(("mid", 0.6), (c, 0.4))]
    (root / "recipe.yml").write_text("---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs))
    return ["run", str(root / "recipe.yml"), "{out}", "--out-shard-size", "10k"]


def _moe(root: Path) -> list[str]:
    a, b, c = _models(root, 3)
    doc = {"base_model": str(a), "gate_mode": "uniform_random",
           "experts": [{"source_model": str(b), "positive_prompts": ["a"]},
                       {"source_model": str(c), "positive_prompts": ["b"]}]}
    return ["run", str(write_config(root / "moe.yml", doc)), "{out}", "--out-shard-size", "10k"]


def _extraction(root: Path) -> list[str]:
    base, ft = _models(root, 2)
    return ["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", "{out}", "--max-rank", "4"]


def _surgery(root: Path) -> list[str]:
    from transplant.pairs import make_pair

    model, donor = (root / "pair" / "model", root / "pair" / "donor")
    if not model.exists():
        model, donor = make_pair(root / "pair")
    return ["tokensurgeon", str(model), str(donor), "{out}", "-k", "8", "--batch-size", "16"]


CASES = (
    Case("merge", _merge, "after_manifest_write:2"),
    Case("recipe", _recipe, "after_manifest_write:3", said="stage in progress"),
    Case("moe", _moe, "after_manifest_write:2"),
    Case("extraction", _extraction, "mid_shard_write", said="decomposed",
         details=("modules_total", "modules_done", "module_current")),
    Case("tokensurgeon", _surgery, "after_surgery_batch:3", said="batches approximated", details=("batches_done",)),
)
# Kinds whose own command has --plan (``resumerge plan`` takes a config), and whose runs compared byte for byte stay
# fresh processes (sums of matrix products: tests/extract/test_resume.py).
OWN_COMMAND = ("extraction", "tokensurgeon")


def test_every_kind_has_its_row() -> None:
    assert sorted(case.kind for case in CASES) == sorted(kind.name for kind in KINDS)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kind-inputs")


def _args(case: Case, root: Path, out: Path, state: Path) -> list[str]:
    return [arg.format(out=out) for arg in case.config(root)] + ["--state-dir", str(state), "-q"]


def _output(out: Path) -> dict[str, str]:
    """The digests of the output's files; resumerge's own records are left out (a recipe's name the folder of its
    intermediate stages, which is beside each OUT)."""
    return {name: digest for name, digest in digests(out).items() if not name.startswith("resumerge-")}


def _as_recorded_before(state: Path) -> None:
    """Every ledger under ``state`` as the version before kinds were recorded left it: no ``kind`` column, its
    migration not applied (the next writer applies it, and the kind stays unrecorded)."""
    for path in state.rglob(LEDGER_NAME):
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE run DROP COLUMN kind")
            db.execute("DELETE FROM _sqlite_migrations WHERE name = 'm005_run_kind'")


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
@pytest.mark.parametrize("case", CASES, ids=[case.kind for case in CASES])
def test_plan_run_kill_resume_status(case: Case, inputs: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Planned (writing nothing), run, and killed; then, once with its kind recorded and once as the version
    before kinds left the same killed run: status says its kind and details, and the resume finishes it with the
    uninterrupted run's bytes. Only the killed run (and an extraction's runs) is a process of its own: the CLI's other
    commands run through its ``main`` in this process (an interpreter and torch start each saved)."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    args = _args(case, inputs, reference / "out", reference / "state")
    assert main([*args[:-1], "--plan"] if case.kind in OWN_COMMAND else ["plan", *args[1:-1]]) == 0
    assert not reference.exists()  # planning wrote nothing
    # an extraction's factors are sums of matrix products: its runs compared bytes for bytes stay fresh processes
    # (tests/extract/test_resume.py); the others' outputs are elementwise, the same in any process
    fresh = case.kind in OWN_COMMAND
    assert (cli(*args).returncode if fresh else main(args)) == 0
    out, state = run / "out", run / "state"
    killed = cli(*_args(case, inputs, out, state), env={"RESUMERGE_KILL_AT": case.kill_at})
    assert killed.returncode == -9, killed.stderr
    shutil.copytree(run, tmp_path / "killed")  # OUT, the state dir and a recipe's intermediates, as killed
    for recorded in ("kind", "before kinds"):
        if recorded != "kind":
            shutil.rmtree(run)
            shutil.copytree(tmp_path / "killed", run)
            _as_recorded_before(state)
        report = api.status(out, settings=api.Settings(state_dir=state))
        assert report.state == "interrupted", (recorded, report)
        if case.kind != "recipe":  # a recipe's own record says what it is; each stage is a merge
            said = report.to_json()
            assert said["kind"] == case.kind, recorded  # as recorded, or (before kinds) as its recorded text says
            assert all(said[key] is not None for key in case.details), (recorded, said)
        capsys.readouterr()
        assert main(["status", str(out), "--state-dir", str(state)]) == 0
        shown = capsys.readouterr().out
        assert case.said in shown, (recorded, shown)
        assert "forward pass" not in shown
        resume = ["resume", str(out), "--state-dir", str(state), "-q"]
        assert (cli(*resume).returncode if fresh else main(resume)) == 0
        assert _output(out) == _output(reference / "out"), recorded
        assert api.status(out, settings=api.Settings(state_dir=state)).state == "done"


def test_a_plain_mixtral_merge_shows_no_forward_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 60 item 5: an MoE pass folder in the state dir (here an empty one) is another run's: the status of a
    plain merge of Mixtral models (whose routers end in ``.gate.weight``) says nothing of a forward pass."""
    mixtral = next(f for f in FAMILIES if f.name == "mixtral")
    a, b = (make_family_model(tmp_path / name, mixtral, seed) for name, seed in (("a", 1), ("b", 2)))
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", cfg, out, "--state-dir", state, "--out-shard-size", "20k", "-q",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:1"})
    assert killed.returncode == -9, killed.stderr
    (state / "moe-routers" / "0123abcd").mkdir(parents=True)
    capsys.readouterr()
    assert main(["status", str(out), "--state-dir", str(state)]) == 0  # the CLI's status, in this process
    shown = capsys.readouterr().out
    assert "interrupted" in shown and "forward pass" not in shown, shown
    assert main(["status", str(out), "--state-dir", str(state), "--json"]) == 0
    assert capsys.readouterr().out.count('"prepass_layers": null') == 1
