"""``check --executor ray`` of hub models (issue 57): a check whose merge, base and parent are ``hf://`` repos of the
stand-in hub, each model's pass in an actor on a Ray node of its own (a real cluster on this machine: a head without
CPUs and three one-CPU worker nodes), gives the local check's report, exactly (the local one on one thread, as the
actors compute on their node's one CPU).

Each actor reads its own model by range from the hub, under its node's name (``resumerge-node/NODE`` in the user
agent), and no process is served a byte twice: the driver reads the headers when it opens the models and every tensor
once in the static pass (which compares the models' tensors with each other, so it runs where they all are: the
driver), each actor the tensors of its model's pass once (the merge's first layer too, which it runs once more to
learn whether the family takes padded batches). So across the cluster each weight byte is fetched twice: once by the
driver, once by the node whose actor runs its model (docs/guide.md says so). A merge of another vocabulary too: the
driver reads the tables no figure compares (each file proved whole against the hub's checksum, as a local check
proves it), each node its model's tensors, the local check's reads but the headers.

The token never travels with the work: every node reads with its own (here the one its processes inherit from this
test, as ``ray start`` on a machine with ``HF_TOKEN`` set gives its node; a node without one, where the driver reads
with one, is refused in one line as its actor starts), and it reaches no Ray log, no file of the state dir, no report
and no error: a parent taken off the hub mid-pass fails its actor's read, said in the driver in one line."""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants
from raycluster import Cluster, RayHead, ray_cluster
from support import one_thread

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub, files_of, iter_requests
from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import ModelInputError
from resumerge.forward.opening.hubreads import READS_NAME
from resumerge.merge.engine.executors import RayExecutor

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SECRET = "hf_rayCheckNeverLogged0123456789"
TEXTS = "the cat sat on the mat\nhello world again\nx\n"
NODE = "resumerge-node/"


def _reads(hub: FakeHub) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """The weight files' byte ranges each process was served: the driver's (no node named) and each node's."""
    found: dict[str, dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for r in iter_requests(hub, "GET"):
        if r.range is not None and r.path.endswith(".safetensors") and r.status == 206:
            first, _, last = r.range.removeprefix("bytes=").partition("-")
            who = r.agent.split(NODE)[1][:8] if NODE in r.agent else "driver"
            repo, _, file = r.path.lstrip("/").partition("/resolve/")
            found[who][f"{repo}/{file.partition('/')[2]}"].append((int(first), int(last) + 1))
    return found


def _once(ranges: list[tuple[int, int]]) -> int:
    """The bytes of ``ranges``, asserting that none was served twice."""
    ranges = sorted(ranges)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges)), f"a byte served twice: {ranges}"
    return sum(end - start for start, end in ranges)


def _tensor_bytes(files: dict[str, bytes], name: str) -> int:
    """The bytes of shard ``name``'s tensors (all of it but its header)."""
    data = files[name]
    return len(data) - 8 - int.from_bytes(data[:8], "little")


def _verified(state: Path) -> list[str]:
    """What the journals of the checks under ``state`` say of their hub files: each one proved against the hub's
    checksum (``verify``) or not every byte read (``unverified``)."""
    found = []
    for journal in (state / "checks").glob(f"*/{READS_NAME}"):
        with sqlite3.connect(journal) as db:
            found += [f"{kind} {message}" for kind, message in
                      db.execute("SELECT kind, message FROM events WHERE kind IN ('verify', 'unverified')")]
    return sorted(found)


def _gone_after_layer_0(hub: FakeHub, repo: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``repo`` taken off the hub once the check journaled its first layer (handed back in the list returned)."""
    import resumerge.forward.job.layerpass

    gone: list[Any] = []

    def take(point: str, **_: object) -> None:
        if point == "after_check_layer" and not gone:
            gone.append(hub.repos.pop(repo))

    monkeypatch.setattr(resumerge.forward.job.layerpass, "reach", take)
    return gone


def _served(tmp_path: Path, hub: FakeHub, models: tuple[Model, Model], merged_spec: ModelSpec, suffix: str = ""
            ) -> tuple[dict[str, Any], Path, tuple[str, str, str]]:
    """A merge (of ``merged_spec``) and a parent pushed to the stand-in hub beside the base (``suffix`` given: the
    base pushed again, each repo's name ending with it, so that no file a check before read is in this check's
    driver's cache): the files each repo serves, the texts file, and the three models' hub paths (merge, base,
    parent)."""
    tmp_path.mkdir(exist_ok=True)
    merged = files_of(make_model(tmp_path / "merged", merged_spec, seed=7))
    beta = files_of(make_model(tmp_path / "beta", SPEC, seed=1))
    base = f"{REPO}{suffix}"
    hub.push(f"org/merged{suffix}", merged)
    hub.push(f"org/beta{suffix}", beta)
    if suffix:
        hub.push(base, models[0].files)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    return ({f"org/merged{suffix}": merged, base: models[0].files, f"org/beta{suffix}": beta}, texts,
            (f"hf://org/merged{suffix}", f"hf://{base}", f"hf://org/beta{suffix}"))


def test_checks_of_hub_models_on_ray_read_what_the_local_check_does_once_per_process_and_never_show_the_token(
        tmp_path: Path, hub: FakeHub, state: Path, models: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], ray_head: RayHead) -> None:
    """Two checks on one cluster of three worker nodes (their nodes and the kept workers the first check leaves on
    them, which host the second's actors, started once: about 20 CPU s and as many seconds of wall less than a
    cluster each): a check of hub models, and one of a merge of another vocabulary."""
    # This machine's token: the cluster's nodes start with it, as this process has it (and send it: hf_env's
    # HF_HUB_DISABLE_IMPLICIT_TOKEN would keep every request without one).
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.delenv("HF_HUB_DISABLE_IMPLICIT_TOKEN")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
    with ray_cluster(ray_head, workers=3) as (cluster, started):
        _a_check_of_hub_models_reads_each_byte_once_per_process_and_never_shows_the_token(
            tmp_path, hub, state, models, cluster)
        with pytest.MonkeyPatch.context() as patch:
            _a_check_of_a_merge_of_another_vocabulary_reads_and_proves_what_the_local_check_does(
                tmp_path / "vocab", hub, models, patch, cluster)
        # The token reached no output and no Ray log (the head's and the nodes').
        logs = {Path(node.get_logs_dir_path()) for node in (started.head_node, *cluster.workers)}
        logged = [p for folder in logs for p in folder.rglob("*") if p.is_file()]
        assert logged and not [p for p in logged if SECRET.encode() in p.read_bytes()]
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err


def _a_check_of_hub_models_reads_each_byte_once_per_process_and_never_shows_the_token(
        tmp_path: Path, hub: FakeHub, state: Path, models: tuple[Model, Model], cluster: Cluster) -> None:
    served, texts, paths = _served(tmp_path, hub, models, SPEC)
    hub.reset_counters()
    with one_thread():  # the pass's count, which its actors compute with: the local reference's
        report = api.check(paths[0], base=paths[1], parents=[paths[2]], prompts=texts,
                           settings=api.Settings(state_dir=state, executor=RayExecutor(cluster.address)))
    reads = _reads(hub)
    on_nodes = [r for r in iter_requests(hub) if NODE in r.agent]
    # A parent gone from the hub after the first layer: its actor's read fails, said in the driver in one line.
    with pytest.MonkeyPatch.context() as patch, pytest.raises(ModelInputError) as failed:
        gone = _gone_after_layer_0(hub, "org/beta", patch)
        api.check(paths[0], base=paths[1], parents=[paths[2]], prompts=texts,
                  settings=api.Settings(state_dir=tmp_path / "gone", executor=RayExecutor(cluster.address)))
    hub.repos["org/beta"] = gone.pop()  # the hub as it was
    assert "org/beta@" in failed.value.one_line() and "HTTP 404" in failed.value.one_line()
    assert SECRET not in str(failed.value) + failed.value.one_line() + repr(failed.value)
    with one_thread():
        local = api.check(paths[0], base=paths[1], parents=[paths[2]], prompts=texts,
                          settings=api.Settings(state_dir=tmp_path / "local"))
    # The local check's report, exactly (each keeps its chart where its journal is: the same bytes).
    doc, expected = (json.loads(json.dumps(r.to_json())) for r in (report, local))
    assert Path(doc.pop("chart")).read_bytes() == Path(expected.pop("chart")).read_bytes()
    assert doc == expected and [m.path for m in report.models] == list(paths)
    # Each node read by range its own model only, with its own token; no process was served a byte twice; the driver
    # read every tensor once (its static pass), each model's node every tensor of its model once (its pass).
    assert set(reads) == {"driver", *cluster.node_ids()}
    assert on_nodes and all(r.authorization == f"Bearer {SECRET}" for r in on_nodes)
    assert not [r for r in on_nodes if not r.path.endswith(".safetensors")]  # their folders are the driver's cache
    shards = {f"{repo}/{name}": files[name] for repo, files in served.items()
              for name in files if name.endswith(".safetensors") and "/" not in name}
    for who, files in reads.items():
        fetched = {path: _once(ranges) for path, ranges in files.items()}
        repos = {path.rsplit("/", 1)[0] for path in fetched}
        if who == "driver":  # every shard's header and tensors
            assert fetched == {path: len(data) for path, data in shards.items()}
        else:
            assert len(repos) == 1, repos
            repo = repos.pop()
            assert fetched == {path: _tensor_bytes(served[repo], path.rsplit("/", 1)[1])
                               for path in shards if path.startswith(f"{repo}/")}
    for path in shards:
        assert sum(path in files for who, files in reads.items() if who != "driver") == 1
    # The token reached no report, no file of the state dir (nor output, nor Ray log: see the test).
    assert SECRET not in json.dumps(report.to_json())
    assert not [p for p in state.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_a_node_without_a_token_refuses_to_read_a_hub_model_in_one_line(hub: FakeHub, state: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the driver reads the hub with a token, a hub model's actor on a node without one says so in one line
    (exit 2) as it starts, as a merge's node does, rather than fail on its first read (a private repo's 401)."""
    import resumerge.machine.rayconnect
    from resumerge.analyses.check.models import open_checked
    from resumerge.config.locations import StateDir
    from resumerge.errors import UsageError
    from resumerge.forward.placing.modelnode import ModelNode

    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")
    model = open_checked(f"hf://{REPO}", "--base", StateDir.resolve(state))
    with one_thread():  # the actor's threads: this process's, for the test
        refused, reads = ModelNode(model, 1, token=True), ModelNode(model, 1, token=False)
    with pytest.raises(UsageError) as said:  # hf_env: no HF_TOKEN, no saved login
        refused.node()
    line = said.value.one_line()
    assert said.value.exit_code == 2 and "0123abcd" in line and f"hf://{REPO}" in line and "HF_TOKEN" in line
    assert reads.failed is None and reads.node() == "0123abcd"  # a driver without a token: none needed


def test_the_merge_s_actor_reads_its_first_layer_once_where_the_family_runs_batches(
        hub: FakeHub, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first layer read to learn whether the family runs padded batches keeps its weights for the pass's first
    layer (a hub model's bytes fetched once); where it does not, or the pass resumes past that layer, they are
    dropped (then it is read again, as one sequence at a time needs)."""
    import resumerge.forward.compared.passes
    import resumerge.forward.text.batches
    import resumerge.machine.rayconnect
    from resumerge.analyses.check.models import open_checked
    from resumerge.config.locations import StateDir
    from resumerge.forward.placing.modelnode import ModelNode

    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")
    model = open_checked(f"hf://{REPO}", "MODEL", StateDir.resolve(state))
    batches = [resumerge.forward.text.batches.padded([[1, 2, 3], [4, 5]])]

    spans = [(t.file, t.entry.start, t.entry.end) for n, t in model.opened.tensors.items() if ".layers.0." in n]

    def first_layer_read() -> float:
        """How many times the first layer's bytes were served since last asked."""
        served = 0
        for r in iter_requests(hub, "GET"):
            first, _, last = (r.range or "bytes=0-0").removeprefix("bytes=").partition("-")
            served += sum(max(0, min(end, int(last) + 1) - max(start, int(first)))
                          for file, start, end in spans if r.path.endswith(f"/{file}"))
        hub.reset_counters()
        return served / sum(end - start for _, start, end in spans)

    with one_thread():
        node = ModelNode(model, 1)
        layer = node.stream.layers_list[0]
        for batched, then, reads in ((True, 0, 1), (True, 1, 1), (False, 0, 2)):
            if not batched:
                monkeypatch.setattr(resumerge.forward.compared.passes, "batched_on", lambda *_: False)
            entering, _ = node.enter(batches)
            hub.reset_counters()
            assert node.runs_batched() is batched
            assert any(not p.is_meta for p in layer.parameters()) is batched  # kept only where it runs batches
            node.layer(then, entering, None)
            assert all(p.is_meta for p in layer.parameters())  # dropped by the pass's first layer (or one past it)
            assert first_layer_read() == reads, (batched, then)


def _a_check_of_a_merge_of_another_vocabulary_reads_and_proves_what_the_local_check_does(
        tmp_path: Path, hub: FakeHub, models: tuple[Model, Model], monkeypatch: pytest.MonkeyPatch,
        cluster: Cluster) -> None:
    """A merge of a larger vocabulary (80 rows, as a ``tokenizer_source: union`` merge has more than its parents'
    64): no figure compares a table of another shape (the static pass names them among the shape problems; the
    heads compare over the shared tokens), yet the nodes read the base's and the parent's tables for their passes,
    so the driver, which runs no forward pass, reads them too: every file of every model once, as the local check
    reads them, each proved whole against the hub's checksum before the report. Its static pass read only what its
    figures compare, and left the base's and the parent's first and last shards (a 64x32 float32 table each) short
    of 8192 bytes and unproved. Each node reads its own model's tensors once: the local check's reads of its files
    but their headers. The driver on Ray, which reads no byte twice, keeps none on disk for a second read (the local
    check keeps the tensors outside the decoder layers, which its static and forward passes both read)."""
    from resumerge.inputs.hub.fetchcache import FetchCache

    kept: list[int] = []  # the bytes of each piece written to the driver's fetch cache
    real = FetchCache.kept
    monkeypatch.setattr(FetchCache, "kept", lambda self, piece, size: (kept.append(size), real(self, piece, size)))
    served, texts, paths = _served(tmp_path, hub, models, replace(SPEC, vocab=80), suffix="-80")
    state = tmp_path / "state"
    hub.reset_counters()
    with one_thread():  # the pass's count, which its actors compute with: the local reference's
        report = api.check(paths[0], base=paths[1], parents=[paths[2]], prompts=texts,
                           settings=api.Settings(state_dir=state, executor=RayExecutor(cluster.address)))
    on_ray = _reads(hub)
    assert not kept
    hub.reset_counters()
    with one_thread():
        local = api.check(paths[0], base=paths[1], parents=[paths[2]], prompts=texts,
                          settings=api.Settings(state_dir=tmp_path / "local"))
    here = _reads(hub)
    assert kept
    # The local check's figures, exactly, over the 64 shared tokens.
    doc, expected = (json.loads(json.dumps(r.to_json())) for r in (report, local))
    assert Path(doc.pop("chart")).read_bytes() == Path(expected.pop("chart")).read_bytes()
    assert doc == expected and report.shared_tokens == 64
    assert {p.split(":")[0] for p in report.static.shape_problems} == {"lm_head.weight", "model.embed_tokens.weight"}
    # The driver read every byte of every file once, as the local check did (its only process).
    shards = {f"{repo}/{name}": files[name] for repo, files in served.items()
              for name in files if name.endswith(".safetensors") and "/" not in name}
    every = {path: len(data) for path, data in shards.items()}
    assert set(here) == {"driver"} and {path: _once(ranges) for path, ranges in here["driver"].items()} == every
    assert {path: _once(ranges) for path, ranges in on_ray["driver"].items()} == every
    # Each node its own model's files once, but their headers (the driver's, from its cache).
    assert set(on_ray) == {"driver", *cluster.node_ids()}
    nodes = [files for who, files in on_ray.items() if who != "driver"]
    assert sorted(path.rsplit("/", 1)[0] for files in nodes for path in files) == \
        sorted(path.rsplit("/", 1)[0] for path in shards)
    for files in nodes:
        repo = next(iter(files)).rsplit("/", 1)[0]
        assert {path: _once(ranges) for path, ranges in files.items()} == \
            {path: size - 8 - int.from_bytes(shards[path][:8], "little") for path, size in every.items()
             if path.startswith(f"{repo}/")}
    # Every file proved against the hub's checksum before the report, on Ray as locally; none left unproved.
    proved = sorted(f"verify {path}: every byte read, checksum matches the hub's" for path in shards)
    assert _verified(state) == _verified(tmp_path / "local") == proved
