"""The stand-in hub refuses what the real Hub refuses, so no test passes against a hub more lenient than the Hub:
a stale ``parent_commit`` (412), an ``lfsFile`` whose object it does not hold (400, the Hub's text), more files in
one preupload call than the Hub takes; and in the Xet tier it serves back, with its ``xetHash``, what hf_xet
uploaded to its ``local://`` CAS."""

from __future__ import annotations

import hashlib
import os
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
from hub.fakehub_write import MISSING_OBJECT, PRECONDITION_FAILED, PREUPLOAD_MAX_FILES, HubWriter
from huggingface_hub import CommitOperationAdd, HfApi, constants, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import get_session
from huggingface_hub.utils._runtime import _package_versions, is_xet_available

from hubout.conftest import TIERS, TOKEN, repo_files
from resumerge.config.hubtarget import parse_hub_target
from resumerge.merge.engine.cluster.upload import (
    HubPlace,
    Uploaded,
    commit_operation,
    upload_shard,
    uploads_through_xet,
)


def _api(hub: HubWriter) -> HfApi:
    return HfApi(endpoint=hub.hub.url, token=TOKEN)


def test_a_stale_parent_and_an_object_never_uploaded_are_refused(hub: HubWriter) -> None:
    api = _api(hub)
    first = hub.create_repo("alice/strict")
    api.create_commit("alice/strict", [CommitOperationAdd("a.txt", b"a")], commit_message="a", parent_commit=first)
    with pytest.raises(HfHubHTTPError) as stale:
        api.create_commit("alice/strict", [CommitOperationAdd("b.txt", b"b")], commit_message="b",
                          parent_commit=first)
    assert stale.value.response.status_code == 412 and stale.value.server_message == PRECONDITION_FAILED
    # An lfsFile line naming an object nobody uploaded (preupload told the client it was there already).
    data = os.urandom(1000)
    op = commit_operation("w.safetensors", len(data), hashlib.sha256(data).hexdigest(), Uploaded("lfs"))
    with pytest.raises(HfHubHTTPError) as missing:
        api.create_commit("alice/strict", [op], commit_message="w")
    assert missing.value.response.status_code == 400 and missing.value.server_message == MISSING_OBJECT
    assert "w.safetensors" not in hub.head_files("alice/strict")


def test_a_node_s_upload_is_committed_from_the_reference_it_hands_back(hub: HubWriter, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster node uploads a shard and deletes it; the driver commits it from the node's reference alone (an
    LFS object by its sha256 and size, a small regular file by its content); the process-wide Xet switch it sets
    for the upload is put back after (a kept worker's process serves the next run). The LFS tier only: the Ray
    test's hub OUT uploads through Xet."""
    hub.create_repo("alice/node")
    place = HubPlace(parse_hub_target("hf://alice/node"), hub.hub.url, hub.cas is not None, "resumerge resume")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", place.xet)  # the other tier than the upload's
    files = {"model.safetensors": os.urandom(3000), "notes.txt": b"small"}
    operations = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        uploaded = upload_shard(place, tmp_path / name, name, sha)
        (tmp_path / name).unlink()
        assert constants.HF_HUB_DISABLE_XET is place.xet
        assert uploaded.mode == ("lfs" if name.endswith(".safetensors") else "regular")
        operations.append(commit_operation(name, len(data), sha, uploaded))
    _api(hub).create_commit("alice/node", operations, commit_message="shards")
    assert repo_files(hub, "alice/node") == files


def test_a_preupload_call_with_too_many_files_is_refused(hub: HubWriter) -> None:
    hub.create_repo("alice/many")

    def preupload(count: int) -> int:
        body = {"files": [{"path": f"f{i}.txt", "size": 1, "sample": ""} for i in range(count)]}
        return get_session().post(f"{hub.hub.url}/api/models/alice/many/preupload/main", json=body,
                                  headers={"authorization": f"Bearer {TOKEN}"}).status_code

    assert preupload(PREUPLOAD_MAX_FILES) == 200 and preupload(PREUPLOAD_MAX_FILES + 1) == 400


@pytest.mark.parametrize("tier", ["xet"], indirect=True)
def test_the_xet_tier_uploads_to_the_local_cas_and_serves_the_files_back(hub: HubWriter) -> None:
    assert TIERS[1] == "xet" and hub.cas is not None
    api = _api(hub)
    hub.create_repo("alice/xet")
    data = os.urandom(300_000)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id="alice/xet")
    sha = hashlib.sha256(data).hexdigest()
    assert not hub.puts and hub.cas.registrations() == {sha: 1} and hub.xet_tokens == 1
    entry = next(e for e in api.list_repo_tree("alice/xet") if e.path == "w.safetensors")
    assert entry.lfs is not None and entry.lfs.sha256 == sha and entry.xet_hash == hub.hub.xet_hashes[sha]
    assert hub.head_files("alice/xet")["w.safetensors"] == data
    with open(hf_hub_download("alice/xet", "w.safetensors", endpoint=hub.hub.url, token=TOKEN), "rb") as f:
        assert f.read() == data
    # A repo deleted and recreated on the Hub: its commits refuse what only Xet holds (huggingface_hub #3829).
    hub.recreated.add("alice/xet")
    with pytest.raises(HfHubHTTPError) as refused:
        api.upload_file(path_or_fileobj=data, path_in_repo="again.safetensors", repo_id="alice/xet")
    assert refused.value.response.status_code == 400 and refused.value.server_message == MISSING_OBJECT


@pytest.mark.parametrize("disabled", [True, False])
def test_the_xet_check_is_the_clients_own(monkeypatch: pytest.MonkeyPatch, disabled: bool) -> None:
    """A cluster's nodes upload in the tier the driver's client would choose: our check agrees with the client's
    (private) one, with hf-xet installed (the suite's environment) and without it."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", disabled)
    assert uploads_through_xet() == is_xet_available() == (not disabled)
    monkeypatch.setitem(_package_versions, "hf_xet", "N/A")  # the client's record of hf-xet: not installed
    monkeypatch.setattr("importlib.metadata.version", _not_installed)
    assert uploads_through_xet() == is_xet_available() is False


def _not_installed(name: str) -> str:
    raise PackageNotFoundError(name)
