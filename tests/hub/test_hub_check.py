"""``resumerge check hf://NAMESPACE/NAME`` (and ``--base``/``--parent hf://...``) on the stand-in hub: the models'
small files come into the cache, their weights are read by HTTP Range, never downloaded whole, and the report is
the one the same models give as local folders. A resumerge output whose hub input was streamed is checked against
that input by range too; a resumerge output on the hub names its parents in its manifest, and its model card is
left as committed, said in one line.

Nothing from the hub is trusted without a checksum: a check that reads every byte of a hub file checks it against
the hub's sha256 before its report (exit 4 naming the file otherwise, its journal discarded), each range's sha256 is
journaled so that a resumed check compares what it reads again, and no byte is fetched twice."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from raystandin import StandInRay
from support import cli_here

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub, files_of, iter_requests
from resumerge import api
from resumerge.analyses.check import CheckReport
from resumerge.cli.modelgen import make_model
from resumerge.forward.opening.hubreads import FETCHED_NAME, READS_NAME

pytest.importorskip("transformers")


def _figures(report: CheckReport) -> list[tuple[str, float | None, float | None, tuple[float, ...]]]:
    return [(m.role, m.nll, m.kl, m.drift) for m in report.models]


def _hub_weights_in_cache(home: Path) -> list[Path]:
    return [p for p in (home / "hub").rglob("*.safetensors")]


def _shards(files: dict[str, bytes]) -> list[str]:
    """The weight files a model's index names (not the decoys beside them)."""
    return sorted(set(json.loads(files["model.safetensors.index.json"])["weight_map"].values()))


def _verified(state: Path) -> list[str]:
    """The files the check's journal says it read whole and found to match the hub's checksum."""
    found = []
    for journal in (state / "checks").glob(f"*/{READS_NAME}"):
        with sqlite3.connect(journal) as db:
            found += [r[0] for r in db.execute("SELECT message FROM events WHERE kind = 'verify'")]
    return sorted(found)


def _flipped(data: bytes, start: int, end: int) -> bytes:
    """``data`` with a low bit of every float32 of ``[start, end)`` flipped: each value a little off."""
    changed = bytearray(data)
    for at in range(start, end, 4):
        changed[at + 1] ^= 1
    return bytes(changed)


def _span(data: bytes, tensor: str) -> tuple[int, int]:
    """Where ``tensor``'s bytes lie in a safetensors file."""
    length = int.from_bytes(data[:8], "little")
    first, last = json.loads(data[8:8 + length])[tensor]["data_offsets"]
    return 8 + length + first, 8 + length + last


def test_hub_models_are_checked_by_range_like_local_folders(tmp_path: Path, hub: FakeHub, state: Path,
                                                            hf_env: Path, models: tuple[Model, Model]) -> None:
    merged = make_model(tmp_path / "merged", SPEC, seed=7)
    beta = make_model(tmp_path / "beta", SPEC, seed=1)
    hub.push("org/merged", files_of(merged))
    hub.push("org/beta", files_of(beta))
    local_alpha = tmp_path / "alpha"
    for name, data in models[0].files.items():
        if "/" not in name and name.endswith((".json", ".safetensors")):
            (local_alpha / name).parent.mkdir(parents=True, exist_ok=True)
            (local_alpha / name).write_bytes(data)
    hub.reset_counters()
    report = api.check("hf://org/merged", base=f"hf://{REPO}", parents=["hf://org/beta"],
                       settings=api.Settings(state_dir=state))
    assert [m.path for m in report.models] == ["hf://org/merged", f"hf://{REPO}", "hf://org/beta"]
    assert not _hub_weights_in_cache(hf_env)  # weights never downloaded: only configs, tokenizer, index
    ranged = [r for r in iter_requests(hub, "GET") if r.range and r.path.endswith(".safetensors")]
    assert ranged and all(not r.path.endswith(("pytorch_model.bin", "model.gguf")) for r in ranged)
    local = api.check(merged, base=local_alpha, parents=[beta],
                      settings=api.Settings(state_dir=tmp_path / "local-state"))
    assert _figures(report)[1:] == _figures(local)[1:] and report.models[0].nll == local.models[0].nll
    assert report.verdict == local.verdict and report.static == local.static
    # Read by range and cheaply: every byte of each weight file served once (header reads included), though the
    # static pass and the forward pass both read the tensors outside the layers; and each file, read whole, checked
    # against the hub's sha256.
    served = hub.file_bytes()
    every = {f"{repo}/{shard}": len(files[shard]) for repo, files in (
        ("org/merged", files_of(merged)), (REPO, models[0].files), ("org/beta", files_of(beta)))
        for shard in _shards(files)}
    assert {k: served.get(k) for k in every} == every
    assert _verified(state) == sorted(f"{k}: every byte read, checksum matches the hub's" for k in every)
    assert not list(state.rglob(FETCHED_NAME)), "the ranges kept for a second read go with the report"
    # A hub OUT is no folder of this machine: its card is left as committed, in one line.
    assert report.card is not None and "hf://org/merged" in report.card and "\n" not in report.card


def test_an_output_whose_hub_input_was_streamed_is_checked_against_it_by_range(
        tmp_path: Path, hub: FakeHub, state: Path, hf_env: Path) -> None:
    other = make_model(tmp_path / "other", SPEC, seed=3)
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {REPO}\n    parameters: {{weight: 0.5}}\n"
                      f"  - model: {other}\n    parameters: {{weight: 0.5}}\n")
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=state, resources=api.Resources(stream_inputs=True)))
    assert not _hub_weights_in_cache(hf_env)  # the merge streamed its hub input
    # its parents from its record: the hub input read by range again
    report = api.check(out, settings=api.Settings(state_dir=state))
    assert [m.role for m in report.models] == ["merge", "parent", "parent"]
    assert report.models[1].path.startswith(f"hf://{REPO}@") and report.models[2].path == str(other)
    assert report.verdict == "works" and all(m.nll is not None for m in report.models)
    assert api.verify(out, settings=api.Settings(state_dir=state)).ok  # the card's section recorded


def test_a_resumerge_output_on_the_hub_names_its_parents_and_keeps_its_card(tmp_path: Path, hub: FakeHub,
                                                                            state: Path) -> None:
    parents = [make_model(tmp_path / f"p{i}", SPEC, seed=i) for i in range(2)]
    config = tmp_path / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=tmp_path / "merge-state"))
    hub.push("org/merged-out", files_of(out))  # as published: the manifest (its record) beside the weights
    report = api.check("hf://org/merged-out",
                       settings=api.Settings(state_dir=state))  # base and parents from the repo's manifest
    assert [(m.role, m.path) for m in report.models] == [("merge", "hf://org/merged-out"),
                                                         *(("parent", str(p)) for p in parents)]
    assert report.verdict == "works"
    assert report.card is not None and "left as committed" in report.card  # no commit to the repo


def test_a_hub_file_served_otherwise_than_its_checksum_stops_the_check_before_its_report(
        tmp_path: Path, hub: FakeHub, state: Path) -> None:
    merged = make_model(tmp_path / "merged", SPEC, seed=7)
    files = files_of(merged)
    hub.push("org/merged", files)
    shard = _shards(files)[1]
    length = 8 + int.from_bytes(files[shard][:8], "little")
    # One bit of one value past the header: each range read is as the hub serves it, the file is not the hub's.
    hub.ranges_from[f"org/merged/{shard}"] = _flipped(files[shard], length, length + 4)
    argv = ["check", "hf://org/merged", "--base", f"hf://{REPO}", "--state-dir", str(state)]
    refused = cli_here(*argv)
    assert refused.returncode == 4, refused.stderr
    assert f"org/merged/{shard}" in refused.stderr and "checksum" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not list(state.rglob("report.json")), "no report from bytes the hub's checksum refutes"
    assert not list((state / "checks").glob(f"*/{READS_NAME}")), "the check's journal is discarded"
    # Served intact again, the check starts over (nothing of the refuted run kept) and verifies every file.
    del hub.ranges_from[f"org/merged/{shard}"]
    again = cli_here(*argv)
    assert again.returncode != 4 and list(state.rglob("report.json")), again.stderr
    assert len(_verified(state)) == len(_shards(files)) * 2


def test_a_resumed_check_reads_no_other_bytes_than_the_killed_one_read(
        tmp_path: Path, hub: FakeHub, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.forward.job import layerpass

    merged = make_model(tmp_path / "merged", SPEC, seed=7)
    files = files_of(merged)
    hub.push("org/merged", files)
    honest = api.check("hf://org/merged", base=f"hf://{REPO}", settings=api.Settings(state_dir=tmp_path / "honest"))

    class Killed(Exception):
        pass

    def kill(point: str, **_: object) -> None:
        if point == "after_check_layer":
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(layerpass, "reach", kill)
        with pytest.raises(Killed):
            api.check("hf://org/merged", base=f"hf://{REPO}", settings=api.Settings(state_dir=state))
    # The hub now serves other bytes for the embeddings and the head, which the killed check read (the static pass
    # first): the resumed check (its forward pass and the heads) reads them from what it kept, compared with its
    # journal, never the hub's.
    where = json.loads(files["model.safetensors.index.json"])["weight_map"]
    changed: dict[str, list[tuple[int, int]]] = {}
    for tensor in ("model.embed_tokens.weight", "lm_head.weight"):
        changed.setdefault(where[tensor], []).append(_span(files[where[tensor]], tensor))
    for shard, spans in changed.items():
        data = files[shard]
        for start, end in spans:
            data = _flipped(data, start, end)
        hub.ranges_from[f"org/merged/{shard}"] = data
    hub.reset_counters()
    resumed = api.check("hf://org/merged", base=f"hf://{REPO}", settings=api.Settings(state_dir=state))
    assert _figures(resumed) == _figures(honest) and resumed.static == honest.static
    fetched = [(r.path.rsplit("/", 1)[1], *map(int, str(r.range)[6:].split("-"))) for r in iter_requests(hub, "GET")
               if r.range and r.path.startswith("/org/merged/")]
    assert not [(f, a, b) for f, a, b in fetched for s, e in changed.get(f, []) if a < e and b >= s]
    # Damaged where it was kept, a range gives other bytes than the killed check read: exit 4, naming the file.
    hub.ranges_from.clear()
    other = tmp_path / "other"
    with monkeypatch.context() as m:
        m.setattr(layerpass, "reach", kill)
        with pytest.raises(Killed):
            api.check("hf://org/merged", base=f"hf://{REPO}", settings=api.Settings(state_dir=other))
    pieces = [p for p in (other / "checks").rglob(f"{FETCHED_NAME}/*/*") if p.is_file()]
    assert pieces
    for piece in pieces:
        data = piece.read_bytes()
        piece.write_bytes(_flipped(data, 0, len(data) - len(data) % 4))
    argv = ["check", "hf://org/merged", "--base", f"hf://{REPO}", "--state-dir", str(other)]
    refused = cli_here(*argv)
    assert refused.returncode == 4 and "gave other bytes" in refused.stderr, refused.stderr
    assert any(f"file {shard} " in refused.stderr for shard in _shards(files))
    assert not list(other.rglob("report.json"))


class _Actor:
    """A :class:`~resumerge.forward.placing.modelnode.ModelNode` as the driver calls a Ray actor
    (``actor.method.remote(...)``), run in this process."""

    def __init__(self, node: object) -> None:
        self._node = node

    def __getattr__(self, name: str) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(remote=getattr(self._node, name))


def test_a_ray_node_s_reads_of_a_hub_model_are_held_to_the_check_s_journal(tmp_path: Path, hub: FakeHub,
                                                                            state: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # --executor ray: each model's forward pass reads its hub files on its node; what it read comes back to the
    # driver after each step, held to the journal as the driver's own reads (the static pass's, first) are.
    import resumerge.machine.rayconnect

    # The actor runs in this process, which is on no Ray node: asking Ray would start a local cluster.
    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")
    from resumerge.analyses.check.models import find_models
    from resumerge.analyses.check.static import static_pass
    from resumerge.config.locations import StateDir
    from resumerge.forward.opening.hubreads import PassReads
    from resumerge.forward.placing.modelnode import ModelNode
    from resumerge.forward.placing.onray import Place, sent
    from resumerge.forward.placing.rayactor import RayModels
    from resumerge.forward.text.batches import padded as _padded
    from resumerge.inputs.hub.integrity import StreamedInputChanged
    from resumerge.merge.store.ledger import Ledger

    merged = make_model(tmp_path / "merged", SPEC, seed=7)
    files = files_of(merged)
    hub.push("org/merged", files)
    models = find_models("hf://org/merged", None, (), StateDir.resolve(state))
    reads = PassReads(tmp_path / "work", Ledger)
    bound = reads.bind(models, fresh=True)
    static_pass(bound)  # every tensor read here, and every file verified whole
    assert len(_verified_in(tmp_path / "work")) == len(_shards(files))
    node = ModelNode(sent(bound[0]), 1)
    held: list[tuple[str, int, int, str]] = []

    def on_reads(m: int, found: list[tuple[str, int, int, str]]) -> None:
        held.extend(found)
        reads.elsewhere(bound[m], found)

    running = RayModels(StandInRay(), bound[:1], [Place("node", 1.0, 0)], 2, None, on_reads)
    running.actors, running.nodes = [_Actor(node)], ["node"]  # as start() leaves them, the actor in this process
    try:
        entering = running.enter([_padded([[1, 5, 9, 3]])])
        assert held and {f for f, *_ in held} <= set(_shards(files))  # the embeddings, read on the node
        layer = json.loads(files["model.safetensors.index.json"])["weight_map"]["model.layers.1.mlp.up_proj.weight"]
        hub.ranges_from[f"org/merged/{layer}"] = _flipped(files[layer], 0, len(files[layer]) - len(files[layer]) % 4)
        hidden, _ = running.layer(0, entering, None)
        with pytest.raises(StreamedInputChanged, match=f"file {layer} gave other bytes"):
            running.layer(1, hidden, None)
    finally:
        node.close()
        reads.close()


def _verified_in(workdir: Path) -> list[str]:
    with sqlite3.connect(workdir / READS_NAME) as db:
        return [r[0] for r in db.execute("SELECT message FROM events WHERE kind = 'verify'")]
