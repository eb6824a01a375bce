"""The forward passes placed on Ray by the executor object (``--executor ray``), as ``check``'s is: ``measure`` (an
actor per model, the models side by side), ``eval`` (its pass's layers on an actor), ``evolve`` (a generation's
candidates spread over the nodes) and mergekit-moe's hidden-state gates (the base's layers on an actor), each giving
the bytes and figures of the local run; and what cannot be placed is refused in one line, exit 2, before any weight
is read.

One real Ray cluster on this machine for the whole module (a head without CPUs, two one-CPU worker nodes: starting
one costs 10-20 s), its worker nodes spare ones (tests/raycluster.py: the nodes the check modules' tests left, with the
kept workers their passes left on them, as a second pass on a user's cluster finds them; its tests' actors read local
files only); the local references run torch on one thread, as each pass on Ray starts (its driver records the count,
and each node's actor computes with it, not with its node's CPUs; float32 sums on more threads may round
otherwise). Tiny generated models."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from raycluster import Cluster, RayHead, ray_cluster
from support import ONE_THREAD, cli, digests, one_thread, write_config

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import UsageError
from resumerge.forward.job.placement import Streams
from resumerge.forward.job.proof import RECORDS_NAME
from resumerge.merge.engine.executors import RayExecutor
from resumerge.runs.moe import gatesites
from tests.moe.passthread import passes_on_a_thread

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
TEXTS = "the cat sat on the mat\nhello world again\nx\n"
RAY_SPARE_NODES = True  # tests/conftest.py: this module runs beside the others that take spare nodes


@pytest.fixture(scope="module")
def cluster(ray_head: RayHead) -> Iterator[Cluster]:
    # Set up before any test's `hermetic` (tests/conftest.py): its nodes start with the settings `hermetic` gives the
    # module's tests (offline, no telemetry), as the check modules' tests' nodes did, so that it takes the nodes they
    # left (tests/raycluster.py: spare nodes serve only a test of the settings they started with).
    with pytest.MonkeyPatch.context() as settings:
        settings.setenv("HF_HUB_OFFLINE", "1")
        settings.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        with ray_cluster(ray_head, workers=2, spare=True) as (started, _):
            yield started


def _measured(root: Path, method: str = "regmean") -> tuple[Path, Path]:
    """A regmean config of two tiny models, and the texts to measure them on."""
    models = [make_model(root / f"m{i}", SPEC, seed=i) for i in range(2)]
    config = write_config(root / f"{method}.yml", {"merge_method": method, "dtype": "float32",
                                                   "models": [{"model": str(m)} for m in models],
                                                   "parameters": {"grams": "grams"}})
    texts = root / "texts.txt"
    texts.write_text(TEXTS)
    return config, texts


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """:func:`_measured`'s config and texts, and the files of their local measurement (torch on one thread, as each
    node's actor computes): made once for the module's measurements on Ray, each into folders of its own."""
    root = tmp_path_factory.mktemp("measured")
    config, texts = _measured(root)
    with one_thread():
        api.measure(config, root / "local", texts=texts, settings=api.Settings(state_dir=root / "s-local"))
    return config, texts, _files(root / "local")


def _not_here(*args: object, **kwargs: object) -> Any:
    pytest.fail("the pass's work ran in the driver's process")


def _files(folder: Path) -> dict[str, Any]:
    return {name: digests(folder / name) for name in ("model-00", "model-01")} | {"": digests(folder)}


def test_a_measure_on_ray_writes_the_local_bytes_and_resumes_a_local_one(tmp_path: Path, cluster: Cluster,
                                                                          measured: tuple[Path, Path, Any]) -> None:
    config, texts, local = measured
    on_ray = RayExecutor(address=cluster.address)
    with pytest.MonkeyPatch.context() as here, one_thread():  # no decoder layer runs in this process: on its node
        here.setattr(Streams, "layer", _not_here)
        report = api.measure(config, tmp_path / "ray", texts=texts, settings=api.Settings(
            state_dir=tmp_path / "s-ray", executor=on_ray, resources=api.Resources(max_memory="8GB")))
    assert not report.reused and report.files == 2 * SPEC.layers
    assert _files(tmp_path / "ray") == local
    # the journal goes once measure.json is written (the models' byte records stay: a repeat is answered from them)
    left = [p.name for p in (tmp_path / "s-ray").glob("measures/*")]
    assert len(left) == 1 and left[0].endswith(f".{RECORDS_NAME}"), left
    # Killed locally after its second layer, the same measurement resumes on Ray with the same bytes.
    killed = cli("measure", config, tmp_path / "both", "--texts", texts, "--state-dir", tmp_path / "s-both",
                 env={"RESUMERGE_KILL_AT": "after_measure_layer:2"}, script=ONE_THREAD)
    assert killed.returncode == -9, killed.stderr
    api.measure(config, tmp_path / "both", texts=texts,
                settings=api.Settings(state_dir=tmp_path / "s-both", executor=on_ray))
    assert _files(tmp_path / "both") == local


def test_a_second_pass_computes_in_the_kept_workers_the_first_left_and_a_killed_driver_frees_them(
        tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch, measured: tuple[Path, Path, Any]) -> None:
    """On a cluster that outlives the pass, each model's actor is hosted by its node's kept worker
    (resumerge.machine.cluster.hosting): a second measurement computes in the same processes (the same actors), as
    does the resume of a measurement whose driver was SIGKILLed on them (each freed once its watchdog saw the driver
    dead); a pass of other code is never served by them (the workers it asks end, and it starts fresh actors);
    ``keep_workers=0`` starts fresh actors. Every one writes the local measurement's bytes."""
    import ray

    from resumerge.forward.placing import onray, rayactor
    from resumerge.machine.cluster import kept

    used: list[list[Any]] = []

    def recorded(ray_: Any, placed: Any, keep: float, stream: str) -> list[Any]:
        hosts = onray.kept_hosts(ray_, placed, keep, stream)
        used.append([None if h is None else h.worker.actor for h in hosts])
        return hosts

    def ids(actors: list[Any]) -> list[str | None]:
        return [None if a is None else a._actor_id.hex() for a in actors]

    monkeypatch.setattr(rayactor, "kept_hosts", recorded)
    config, texts, local = measured
    for run, executor in (("first", RayExecutor(address=cluster.address)),
                          ("second", RayExecutor(address=cluster.address)),
                          ("fresh", RayExecutor(address=cluster.address, keep_workers=0))):
        with one_thread():  # the count the pass records, which each node's actor computes with
            api.measure(config, tmp_path / run, texts=texts,
                        settings=api.Settings(state_dir=tmp_path / f"s-{run}", executor=executor))
        assert _files(tmp_path / run) == local, run
    first = ids(used[0])
    assert None not in first and len(set(first)) == 2 and ids(used[1]) == first and used[2] == [None, None]
    # A driver SIGKILLed holding the kept workers: each frees itself; the resume computes in them.
    killed = cli("measure", config, tmp_path / "killed", "--texts", texts, "--state-dir", tmp_path / "s-killed",
                 "--executor", "ray", "--ray-address", cluster.address,
                 env={"RESUMERGE_KILL_AT": "after_measure_layer:2"}, timeout=600, script=ONE_THREAD)
    assert killed.returncode == -9, killed.stderr[-2000:]
    deadline = time.monotonic() + 120  # the watchdog looks every 0.25 s; a loaded machine delays it
    while any(_leased(ray, actor) for actor in used[0]):
        assert time.monotonic() < deadline, "a dead driver's kept worker was not freed"
        time.sleep(0.2)
    api.measure(config, tmp_path / "killed", texts=texts,
                settings=api.Settings(state_dir=tmp_path / "s-killed", executor=RayExecutor(address=cluster.address)))
    assert ids(used[-1]) == first and _files(tmp_path / "killed") == local
    # A pass of other code asks other names: the workers made for it end at once (their own code is not their
    # names'), refusing it; it computes on fresh actors. Each node is asked once: a worker made at its next slot
    # would run the node's code too.
    monkeypatch.setattr(kept, "run_digest", lambda ray_: "0" * 16)
    asked: list[tuple[str, int, bool]] = []
    slots = kept._slots

    def recorded_slots(*args: Any) -> list[tuple[str, int, bool]]:
        asked.extend(found := slots(*args))
        return found

    monkeypatch.setattr(kept, "_slots", recorded_slots)
    with one_thread():
        api.measure(config, tmp_path / "other", texts=texts, settings=api.Settings(
            state_dir=tmp_path / "s-other", executor=RayExecutor(address=cluster.address)))
    assert used[-1] == [None, None] and _files(tmp_path / "other") == local
    assert sorted((node[:8], slot) for node, slot, _ in asked) == sorted((n, 0) for n in cluster.node_ids()), asked


def _freed(seconds: float = 30.0) -> None:
    """Wait until no live run holds a kept worker of this code on the cluster's nodes: a killed driver's are freed
    once Ray and their watchdogs see it dead (seconds); a pass that asks before finds them held, and makes a worker
    at the node's next slot (a process importing torch) instead."""
    import ray

    from resumerge.machine.cluster.keeper import run_digest
    from resumerge.machine.cluster.kept import NAMESPACE, SPARE_SLOTS, kept_name

    code, actors = run_digest(ray), []
    for node in ray.nodes():
        for slot in range(int(node["Resources"].get("CPU", 0)) + SPARE_SLOTS if node["Alive"] else 0):
            try:
                actors.append(ray.get_actor(kept_name(code, node["NodeID"], slot), namespace=NAMESPACE))
            except ValueError:
                continue
    def held(actor: Any) -> bool:
        try:
            return _leased(ray, actor)
        except ray.exceptions.RayActorError:  # ended meanwhile: held by no one
            return False

    deadline = time.monotonic() + seconds
    while any(held(actor) for actor in actors):
        assert time.monotonic() < deadline, "a dead driver's kept worker was not freed"
        time.sleep(0.2)


def _leased(ray: Any, actor: Any) -> bool:
    """Whether a live driver holds the kept worker ``actor``: it refuses a lease (which, granted, is released)."""
    from resumerge.machine.cluster.keeper import run_digest

    code = run_digest(ray)
    box = [ray.put(code)]
    served = ray.get(actor.lease.remote(box, code, 600.0), timeout=30)
    if served is None:
        return True
    ray.get(actor.release.remote(box), timeout=30)
    return False


def test_an_evaluation_on_ray_gives_the_local_results_and_resumes_either_way(tmp_path: Path,
                                                                             cluster: Cluster) -> None:
    pytest.importorskip("lm_eval")
    from tests.evaluation.evaltasks import tiny_model, write_tasks

    model, tasks = tiny_model(tmp_path / "model"), write_tasks(tmp_path)
    names, asked = ["tiny_mc", "tiny_ppl"], api.Harness(include_path=tasks, limit=4)
    with one_thread():
        local = api.evaluate(model, names, api.Settings(state_dir=tmp_path / "local"), harness=asked)
    on_ray = RayExecutor(address=cluster.address)
    layers: list[int | None] = []
    with pytest.MonkeyPatch.context() as here, one_thread():  # no decoder layer runs in this process: on the node
        here.setattr(Streams, "layer", _not_here)
        found = api.evaluate(model, names, api.Settings(state_dir=tmp_path / "ray", executor=on_ray), harness=asked,
                             progress=lambda step: layers.append(step.layer))
    assert found.to_json()["results"] == local.to_json()["results"]
    assert layers == [0, 1, 2, None] * 2  # both passes, each layer on the node and the head here
    # Asked again locally, the Ray evaluation's journal answers: its passes are the local passes' files.
    again = api.evaluate(model, names, api.Settings(state_dir=tmp_path / "ray"), harness=asked,
                         progress=lambda step: pytest.fail(f"ran again: {step}"))
    assert again.to_json()["results"] == local.to_json()["results"]
    # A merge config (merged in this process) and generation tasks (their layers run here, against the KV cache kept
    # here) are refused on Ray.
    config = write_config(tmp_path / "merge.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(model), "parameters": {"weight": 1.0}}]})
    with pytest.raises(UsageError, match="a merge config is merged in this process"):
        api.evaluate(config, names, api.Settings(state_dir=tmp_path / "s", executor=on_ray), harness=asked)
    with pytest.raises(UsageError, match="generation task"):
        api.evaluate(model, ["tiny_gen"], api.Settings(state_dir=tmp_path / "s", executor=on_ray),
                     harness=api.Harness(include_path=tasks))


def test_a_search_on_ray_spreads_each_generation_over_the_nodes_with_the_local_files(tmp_path: Path,
                                                                                    cluster: Cluster) -> None:
    # Both scorers of a search on the nodes: the streamed kl pass and lm-eval's task, one candidate on each node.
    pytest.importorskip("lm_eval")
    from resumerge.runs.evolve.lmeval import LmEvalCandidates
    from resumerge.runs.evolve.streamed import StreamedCandidates
    from tests.evaluation.evaltasks import tiny_model, write_tasks
    from tests.evolve.test_lmeval import _config
    from tests.evolve.test_search import FILES, OPTIONS

    for seed, name in enumerate(("base", "a", "b")):
        tiny_model(tmp_path / name, seed=seed, context=64)
    write_tasks(tmp_path)
    (tmp_path / "a.txt").write_text("alpha beta gamma delta\nsigma omega rho tau\n")
    config = _config(tmp_path, [{"name": "tiny_mc", "metric": "acc,none", "weight": 2.0},
                                {"kl": {"parent": str(tmp_path / "a"), "texts": str(tmp_path / "a.txt")}}])
    with one_thread():
        api.evolve(config, tmp_path / "local", search=api.Search(**OPTIONS), task_search_path=tmp_path / "tasks")
    # Each node's torch computes with the thread count the search recorded as it started (one, as the local one):
    # the files are the local search's whatever the nodes' CPUs.
    with pytest.MonkeyPatch.context() as here, one_thread():  # no candidate scored in this process: each on a node
        here.setattr(StreamedCandidates, "score", _not_here)
        here.setattr(LmEvalCandidates, "score", _not_here)
        api.evolve(config, tmp_path / "ray", api.Settings(executor=RayExecutor(address=cluster.address)),
                   search=api.Search(**OPTIONS), task_search_path=tmp_path / "tasks")
    assert (tmp_path / "ray" / "threads.json").read_text() == '{"threads": 1}'
    for name in FILES:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


def test_a_moe_s_hidden_gates_on_ray_give_the_local_bytes_and_resume_a_local_kill(tmp_path: Path,
                                                                                  cluster: Cluster) -> None:
    # mergekit-moe's gate_mode hidden: the prompt pass's base layers on an actor (placed by the executor as a
    # check's are), the merge's shards on the nodes' workers, the routers reaching them with the run's resources.
    models = [make_model(tmp_path / f"m{i}", SPEC, seed=30 + i) for i in range(3)]
    config = write_config(tmp_path / "hidden.yml", {
        "base_model": str(models[0]), "gate_mode": "hidden", "dtype": "float32",
        "experts": [{"source_model": str(models[1]), "positive_prompts": ["ab cd"], "negative_prompts": ["xy"]},
                    {"source_model": str(models[2]), "positive_prompts": ["Zq rs tu"]}]})
    # The prompt work done here (the local reference's whole pass, torch on one thread as each node's actor computes;
    # the Ray runs' tokenising of the prompts) on a thread of this process: its process is not what this tests (an
    # interpreter start with torch and transformers saved each time, ~6 CPU s). The killed run below has its own.
    with one_thread(), passes_on_a_thread():
        api.run(config, tmp_path / "local", settings=api.Settings(state_dir=tmp_path / "s-local"))
    on_ray = RayExecutor(address=cluster.address)
    with pytest.MonkeyPatch.context() as here, one_thread(), passes_on_a_thread():  # no decoder layer runs here
        here.setattr(Streams, "layer", _not_here)
        here.setattr(gatesites, "start_child", _encode_only(gatesites.start_child))
        api.run(config, tmp_path / "ray", settings=api.Settings(state_dir=tmp_path / "s-ray", executor=on_ray))
    assert digests(tmp_path / "ray") == digests(tmp_path / "local")
    (routers,) = (tmp_path / "s-local").glob("moe-routers/*/routers.safetensors")  # keyed by content: the same key
    assert (tmp_path / "s-ray" / routers.relative_to(tmp_path / "s-local")).read_bytes() == routers.read_bytes()
    # Killed locally after the pass journaled its first layer, the same run goes on on Ray from its second.
    killed = cli("run", config, tmp_path / "both", "--state-dir", tmp_path / "s-both", "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_router_layer:1", "RESUMERGE_PAUSE_AT": "after_router_layer:1"},
                 script=ONE_THREAD)  # the pass's process on one thread, as each node's actor computes
    assert killed.returncode == -9, killed.stderr
    (work,) = (tmp_path / "s-both" / "moe-routers").iterdir()
    assert sorted(p.name for p in work.iterdir()) == ["layer-00000.safetensors"]
    with passes_on_a_thread():
        api.run(config, tmp_path / "both", settings=api.Settings(state_dir=tmp_path / "s-both", executor=on_ray))
    assert digests(tmp_path / "both") == digests(tmp_path / "local")


def _encode_only(start: Any) -> Any:
    """``start_child`` that refuses any job but tokenising the prompts (the pass itself must not run here)."""

    def started(job: dict[str, Any], *args: Any) -> Any:
        assert job["job"] == "encode", job["job"]
        return start(job, *args)

    return started


def test_glm5s_handed_on_values_are_journaled_from_the_nodes_and_put_back_there(tmp_path: Path,
                                                                                cluster: Cluster) -> None:
    """GLM-5's layers hand their top-k indices to the next (tests/test_handed_passes.py): an evaluation killed on
    Ray after layer 2 (of 4) has layer 2's indices journaled from its actor, and resumed on Ray puts them back in a
    new actor; a measurement killed here resumes on Ray the same way. Before, a resumed GLM-5 pass on Ray stopped
    at layer 3 in one line. The figures and bytes are the local pass's."""
    pytest.importorskip("lm_eval")
    from test_handed_passes import carried_in, glm5, regmean_of_glm5

    from tests.evaluation.evaltasks import write_tasks

    model, tasks = glm5(tmp_path / "glm5"), write_tasks(tmp_path)
    asked = api.Harness(include_path=tasks, limit=4)
    with one_thread():
        local = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=tmp_path / "local"), harness=asked)
    killed = cli("eval", model, "--tasks", "tiny_ppl", "--include-path", tasks, "--limit", "4", "--state-dir",
                 tmp_path / "s", "--executor", "ray", "--ray-address", cluster.address,
                 env={"RESUMERGE_KILL_AT": "after_eval_layer:3"}, timeout=600, script=ONE_THREAD)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert carried_in(tmp_path / "s", "layer-*.safetensors") == [("2", "0")]
    _freed()  # the resume's actor hosted by the kept worker the killed pass's was (not one made at the next slot)
    on_ray = RayExecutor(address=cluster.address)
    with pytest.MonkeyPatch.context() as here:  # no decoder layer runs in this process: each runs on the node
        here.setattr(Streams, "layer", _not_here)
        found = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=tmp_path / "s", executor=on_ray),
                             harness=asked)
    assert found.to_json()["results"] == local.to_json()["results"]
    config, texts = regmean_of_glm5(tmp_path)
    with one_thread():
        api.measure(config, tmp_path / "grams-local", texts=texts,
                    settings=api.Settings(state_dir=tmp_path / "s-local"))
    killed = cli("measure", config, tmp_path / "grams", "--texts", texts, "--state-dir", tmp_path / "s-m",
                 env={"RESUMERGE_KILL_AT": "after_measure_layer:3"}, script=ONE_THREAD)
    assert killed.returncode == -9, killed.stderr[-2000:]
    with pytest.MonkeyPatch.context() as here:
        here.setattr(Streams, "layer", _not_here)
        api.measure(config, tmp_path / "grams", texts=texts,
                    settings=api.Settings(state_dir=tmp_path / "s-m", executor=on_ray))
    assert _files(tmp_path / "grams") == _files(tmp_path / "grams-local")


def test_what_a_pass_on_ray_cannot_do_is_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    config, texts = _measured(tmp_path, "regmean_plus")
    with pytest.raises(UsageError, match="regmean_plus config's merged pass"):
        api.measure(config, tmp_path / "g", texts=texts,
                    settings=api.Settings(executor=RayExecutor(), state_dir=tmp_path / "s"))
    assert not (tmp_path / "g").exists()
