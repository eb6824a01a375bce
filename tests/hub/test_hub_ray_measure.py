"""``measure --executor ray`` of hub models: each model's pass on a Ray node of its own, the sha256 of each range it
read held to the driver's journal; the driver reads those ranges too, once each, so that every hub file the measurement
reads whole is proved against the hub's checksum before ``measure.json``, as a local measure proves it, and a file
served otherwise than its checksum is refused as the local measure refuses it. Its fetch cache keeps nothing (it reads
each byte once)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from raycluster import RayHead, ray_cluster
from support import digests, one_thread, write_config

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub, files_of
from resumerge import api
from resumerge.cli.modelgen import make_model
from resumerge.inputs.hub.fetchcache import FetchCache
from resumerge.inputs.hub.integrity import StreamedInputChanged
from resumerge.merge.engine.executors import RayExecutor
from resumerge.merge.store.ledger import Ledger

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TEXTS = "the cat sat on the mat\nhello world again\n"


def _told(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[int]]:
    """What the measurements' hub journals say of each file (the journal goes once measure.json is written): proved
    against the hub's checksum (``verify``) or not every byte read (``unverified``); and the bytes of each piece
    written to a fetch cache."""
    said: list[str] = []
    kept: list[int] = []
    event, keep = Ledger.event, FetchCache.kept

    def told(self: Ledger, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        if kind in ("verify", "unverified"):
            said.append(f"{kind} {message}")
        event(self, kind, message, data)

    def cached(self: FetchCache, piece: Path, size: int) -> None:
        kept.append(size)
        keep(self, piece, size)

    monkeypatch.setattr(Ledger, "event", told)
    monkeypatch.setattr(FetchCache, "kept", cached)
    return said, kept


def _flipped(data: bytes, start: int, end: int) -> bytes:
    """``data`` with a low bit of every float32 of ``[start, end)`` flipped: each value a little off."""
    changed = bytearray(data)
    for at in range(start, end, 4):
        changed[at + 1] ^= 1
    return bytes(changed)


def test_a_measure_of_hub_models_on_ray_proves_and_refuses_each_file_as_the_local_one(
        tmp_path: Path, hub: FakeHub, state: Path, models: tuple[Model, Model], ray_head: RayHead,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The local measure reads every decoder layer and the embeddings (not the final norm nor the head): the files
    holding only those are proved whole, the others said unverified. On Ray the driver read nothing before: each of
    its files was only journaled per range (all unverified)."""
    beta = files_of(make_model(tmp_path / "beta", SPEC, seed=1))
    hub.push("org/beta", beta)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    config = write_config(tmp_path / "hub.yml", {"merge_method": "regmean", "dtype": "float32",
                                                 "models": [{"model": REPO}, {"model": "org/beta"}],
                                                 "parameters": {"grams": "grams"}})
    said, kept = _told(monkeypatch)
    shard = sorted(name for name in beta if name.endswith(".safetensors") and "/" not in name)[1]
    length = 8 + int.from_bytes(beta[shard][:8], "little")
    refused: list[str] = []
    with ray_cluster(ray_head, workers=2, spare=True) as (cluster, _):
        with one_thread():  # the pass's count, which its actors compute with: the local reference's
            api.measure(config, tmp_path / "ray", texts=texts,
                        settings=api.Settings(state_dir=state, executor=RayExecutor(cluster.address)))
        on_ray, said[:], kept_on_ray = sorted(said), [], list(kept)
        # One bit of one value past a header: each range read is as the hub serves it, the file is not the hub's.
        hub.ranges_from[f"org/beta/{shard}"] = _flipped(beta[shard], length, length + 4)
        with pytest.raises(StreamedInputChanged) as failed:
            api.measure(config, tmp_path / "bad-ray", texts=texts,
                        settings=api.Settings(state_dir=tmp_path / "s-bad-ray", executor=RayExecutor(cluster.address)))
        refused.append(failed.value.one_line())
    with one_thread():
        with pytest.raises(StreamedInputChanged) as failed:
            api.measure(config, tmp_path / "bad", texts=texts, settings=api.Settings(state_dir=tmp_path / "s-bad"))
        refused.append(failed.value.one_line())
        del hub.ranges_from[f"org/beta/{shard}"]
        said[:] = []
        api.measure(config, tmp_path / "local", texts=texts, settings=api.Settings(state_dir=tmp_path / "s-local"))
    # Each hub file proved (or not) on Ray as locally: those the pass reads whole, against the hub's checksum.
    proved = [f"verify org/{repo}/model-0000{i}-of-00005.safetensors: every byte read, checksum matches the hub's"
              for repo in ("alpha", "beta") for i in (1, 2, 3)]
    assert on_ray == sorted(said) and [line for line in on_ray if line.startswith("verify")] == proved
    # The corrupt file refused on Ray as locally (exit 4), naming it and the checksum, before measure.json.
    assert refused[0] == refused[1] and f"org/beta/{shard}" in refused[0] and "checksum" in refused[0]
    assert failed.value.exit_code == 4 and not (tmp_path / "bad-ray" / "measure.json").exists()
    assert not kept_on_ray and kept  # on Ray the driver reads each byte once: it keeps none for a second read
    for folder in ("model-00", "model-01"):  # the Grams, byte for byte
        assert digests(tmp_path / "ray" / folder) == digests(tmp_path / "local" / folder), folder
