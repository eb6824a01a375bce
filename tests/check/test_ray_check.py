"""``check --executor ray``: each model's forward pass on a Ray node of its own, on a real cluster on this machine (a
head without CPUs and three one-CPU worker nodes: one per model of a merge, its base and a parent); ``run --check``
on Ray checks on Ray too (its executor handed on: tested without a cluster); a node lost mid-pass moves its model to
a node left, or with none free stops the check resumably (exit 3). (A cluster whose nodes cannot hold a model's actor:
tests/check/test_ray_refused.py, whose node cannot be a spare one.)

The tests with a cluster of local models share their worker nodes (``spare`` nodes, tests/raycluster.py: each
started once for them and tests/check/test_ray_vocabs.py's check). A check whose driver (the real CLI, joined to
the cluster by ``--ray-address``) is SIGKILLed after a layer on Ray (each model on a node of its own, ``status``
naming them), resumed locally and killed again after the last layer, and finished on Ray (the heads only) gives the
local check's report, exactly (the actors compute with the check's recorded thread count, not their node's CPUs:
each check here starts on one thread, as the local reference runs, as float32 sums on more threads may round
otherwise); ``run --check`` hands the check its run's executor; the CLI without Ray installed exits 2 naming the
install line.

Tiny generated models (three layers, width 32, a byte-level tokenizer): the merge checked and its local check are
made once for the module (the ``merged`` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from raycluster import RayHead, ray_cluster
from support import ONE_THREAD, cli, one_thread

from resumerge import api
from resumerge.analyses.check.progress import find_progress
from resumerge.analyses.check.report import CheckReport
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.merge.engine.cluster import STREAM
from resumerge.merge.engine.executors import RayExecutor

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
RAY_SPARE_NODES = True  # tests/conftest.py: this module runs beside the others that take spare nodes
TEXTS = "the cat sat on the mat\nhello world again\nx\n"


@dataclass(frozen=True)
class Merged:
    """A resumerge output (a linear merge of two tiny models, the first its base), its config, the texts to check
    it on, and its local check's report (torch on one thread, as each node's actor computes): made once for the
    module, read only by its tests (each check keeps its journal in a state dir of its own)."""

    config: Path
    out: Path
    texts: Path
    local: CheckReport


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Merged:
    root = tmp_path_factory.mktemp("merged")
    parents = [make_model(root / f"p{i}", SPEC, seed=i) for i in range(2)]
    config = root / "merge.yml"
    config.write_text(f"merge_method: linear\nbase_model: {parents[0]}\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    api.run(config, root / "out", settings=api.Settings(state_dir=root / "state"))
    texts = root / "texts.txt"
    texts.write_text(TEXTS)
    with one_thread():
        local = api.check(root / "out", prompts=texts, settings=api.Settings(state_dir=root / "local"))
    assert [m.role for m in local.models] == ["merge", "base", "parent"] and local.models[2].kl
    return Merged(config, root / "out", texts, local)


def _same(doc: dict[str, Any], reference: CheckReport) -> None:
    """``doc`` (a report's JSON) is ``reference``'s, but for where each keeps its chart (the same bytes)."""
    expected = json.loads(json.dumps(reference.to_json()))
    assert reference.chart is not None
    assert Path(doc.pop("chart")).read_bytes() == Path(expected.pop("chart")).read_bytes()
    assert doc == expected


def _cli(out: Path, texts: Path, state: Path, *extra: str,
         kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI's check in a process of its own, torch on one thread (as the local reference), forked from the
    worker's fork server where it may be (tests/onethread.py)."""
    return cli("check", out, "--prompts", texts, "--json", "--state-dir", state, *extra, script=ONE_THREAD,
               env={} if kill_at is None else {"RESUMERGE_KILL_AT": kill_at}, timeout=300)


def test_a_check_on_ray_runs_each_model_on_its_own_node_and_resumes_either_way(tmp_path: Path, ray_head: RayHead,
                                                                                merged: Merged) -> None:
    out, texts, local = merged.out, merged.texts, merged.local
    with ray_cluster(ray_head, workers=3, spare=True) as (cluster, _):
        # The real CLI on Ray, SIGKILLed after layer 1 of 3: status says where it was and on which nodes, a node of
        # its own for each model. Each run below passes the kill point once per layer it runs: one started over
        # would die after layer 1 again.
        state = tmp_path / "killed"
        on_cluster = ("--executor", "ray", "--ray-address", cluster.address)
        # Killed on Ray after layer 0, resumed locally and killed after the last layer (its second).
        for executor, journal, nth in ((on_cluster, "layer-00000", 1), ((), "layer-00002", 2)):
            killed = _cli(out, texts, state, *executor, kill_at=f"after_check_layer:{nth}")
            assert killed.returncode == -9, killed.stderr[-2000:]
            assert [p.name for p in state.rglob("layer-*.safetensors")] == [f"{journal}.safetensors"]
            if journal == "layer-00000":
                # type: ignore[union-attr]
                row = dict(api.status(out, settings=api.Settings(state_dir=state)).details.rows)["check"]
                assert row.startswith("interrupted: layer 1 of 3, 3 models on Ray nodes ") and "(parent)" in row
                found = find_progress(state / "checks", out)
                assert found is not None and found["roles"] == ["merge", "base", "parent"]
                assert sorted(found["nodes"]) == sorted(cluster.node_ids())
        # Every layer journaled: on Ray again, the heads only.
        resumed = _cli(out, texts, state, *on_cluster, kill_at="after_check_layer:1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _same(json.loads(resumed.stdout), local)
    assert not list(state.rglob("layer-*.safetensors"))


def test_without_ray_a_check_on_ray_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from resumerge.cli.commands import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as where it is not installed
    assert main(["check", str(tmp_path / "nowhere"), "--executor", "ray", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Ray, which is not installed" in err and "pip install" in err and "Traceback" not in err
    assert main(["check", str(tmp_path), "--ray-address", "somewhere:6379", "--state-dir", str(tmp_path)]) == 2


def test_a_check_runs_where_the_executor_object_says() -> None:
    from resumerge.api.checked import check_placement
    from resumerge.config.passplace import HERE, PassPlace
    from resumerge.errors import UsageError
    from resumerge.merge.engine.executors import LocalExecutor

    assert check_placement(None) == check_placement(LocalExecutor()) == HERE
    assert check_placement(RayExecutor("head:6379", keep_workers=0)) == PassPlace("ray", "head:6379", 0.0, STREAM)
    with pytest.raises(UsageError, match="LocalExecutor or RayExecutor"):
        check_placement("ray")


def test_run_check_hands_the_check_its_run_s_executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      merged: Merged) -> None:
    """``run --check`` checks where the run ran: its executor reaches the check (a cluster's address included)."""
    import resumerge.analyses.check.run
    from resumerge.analyses.check.job import CheckSettings
    from resumerge.api.checked import checked
    from resumerge.config.locations import StateDir
    from resumerge.config.passplace import HERE, PassPlace
    from resumerge.merge.engine.executors import LocalExecutor

    seen: list[PassPlace] = []

    def placed(_asked: object, settings: CheckSettings, *_: object) -> None:
        seen.append(settings.placement)

    monkeypatch.setattr(resumerge.analyses.check.run, "run_check", placed)
    ran = api.run(merged.config, tmp_path / "again", settings=api.Settings(state_dir=tmp_path / "state",
                                                                           executor=LocalExecutor()), check=True)
    checked(ran, state=StateDir.resolve(tmp_path / "state"), max_memory=None,
            executor=RayExecutor("head:6379", keep_workers=0))
    assert seen == [HERE, PassPlace("ray", "head:6379", 0.0, STREAM)]


def test_a_node_lost_mid_pass_moves_its_model_to_a_node_left_else_the_check_stops_resumably(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_head: RayHead, merged: Merged) -> None:
    """A worker node running a model's actor dies (all its processes) after the pass journaled layer 0 (the merge's
    node, the first time the merge's and the base's). With a spare node, the model gets a new actor there, which runs
    its part of layer 1 from the hidden states the driver holds, and the check ends with the local check's report,
    exactly. With none left free (every node left runs an actor on its one CPU), the check stops unreachable (exit
    3), its journal kept; run again, it ends with that report too. While a check runs, Ray holds
    the memory each actor declared."""
    import ray

    import resumerge.forward.job.layerpass
    from resumerge.errors import UnreachableError
    from resumerge.machine.torch_import import IMPORT_RESERVE

    out, texts, local = merged.out, merged.texts, merged.local
    nodes: list[list[str]] = []
    held: list[float] = []
    lost = tmp_path / "lost"
    with ray_cluster(ray_head, workers=4, spare=True) as (cluster, started):
        # Fresh actors, ended with the check (keep_workers=0: the memory they hold is the check's own); the memory
        # that the idle kept workers the tests before left on these nodes hold is not the check's.
        on_cluster = RayExecutor(cluster.address, keep_workers=0)
        idle = ray.cluster_resources()["memory"] - ray.available_resources()["memory"]
        left = list(cluster.workers)

        def lose(point: str, **_: object) -> None:  # after each layer journaled: where the models ran
            if point != "after_check_layer":
                return
            found = find_progress(state / "checks", out)
            assert found is not None
            nodes.append(list(found["nodes"]))
            if len(nodes) == 1:
                held.append(ray.cluster_resources()["memory"] - ray.available_resources()["memory"] - idle)
                victim = next(w for w in left if w.node_id[:8] == nodes[0][0])
                started.remove_node(victim)
                left.remove(victim)

        monkeypatch.setattr(resumerge.forward.job.layerpass, "reach", lose)
        state = lost / "spare"
        with one_thread():  # the count the pass records, which each node's actor computes with (not its CPUs)
            report = api.check(out, prompts=texts, settings=api.Settings(state_dir=state, executor=on_cluster))
        spare = cluster.node_ids() - set(nodes[0])
        _same(json.loads(json.dumps(report.to_json())), local)
        assert len(nodes) == 3 and len(set(nodes[0])) == 3
        assert nodes[1][0] in spare and nodes[1][1:] == nodes[0][1:] == nodes[2][1:]  # only the merge's actor moved
        assert 3 * IMPORT_RESERVE < held[0] < 3 * IMPORT_RESERVE + (64 << 20)  # three actors' imports and steps
        # Three nodes left, one model each: no room for a lost one's actor. The actors hosted by the nodes' kept
        # workers this time (those the tests before left there: no process started again), whose lost one is
        # replaced as a fresh one is.
        nodes.clear()
        state = lost / "none"
        # Started with torch on one thread here, as each node's actor computes: the pass records that count.
        with pytest.raises(UnreachableError, match="no node left has the CPUs") as stopped, one_thread():
            api.check(out, prompts=texts, settings=api.Settings(state_dir=state, executor=RayExecutor(cluster.address)))
        assert stopped.value.exit_code == 3 and len(nodes) == 1
        assert [p.name for p in state.rglob("layer-*.safetensors")] == ["layer-00000.safetensors"]
    monkeypatch.undo()
    # Run again here, on this process's own thread count: a check started on Ray resumes locally (its journal is the
    # same) and computes with the count it started with.
    again = api.check(out, prompts=texts, settings=api.Settings(state_dir=state))
    _same(json.loads(json.dumps(again.to_json())), local)
