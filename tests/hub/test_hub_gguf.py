"""A GGUF file in a hub repo as a model input (``model: org/repo/path/file.gguf[@revision]``, or
``org/repo@revision/path/file.gguf``), from the stand-in hub: its headers are read by range, and its tensors
fetched as a safetensors shard's are (downloaded while merging, or streamed by range and checked against the hub's
sha256, in the LFS and the Xet tier; an interrupted streamed run resumes by range at its pinned commit); the
merge, a GGUF output and ``check`` equal those of the same file read locally; ``plan`` reads headers only; a repo
without the file, a file that is not a GGUF and a family resumerge does not map are refused in one line (exit 2)
before the file is downloaded."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ggufmodels import Q, decoded, hf_tensors, to_gguf, write_gguf
from safetensors.torch import save_file
from support import cli, cli_here, digests, write_config

from hub.fakehub import FakeHub
from resumerge.cli.commands import main
from resumerge.inputs.hub.gguf import FIRST_READ

REPO = "org/tiny-GGUF"
FILE = "quant/tiny.Q8_0.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A llama GGUF (Q8_0), a safetensors parent of its family, and a GGUF of a family resumerge does not map."""
    root = tmp_path_factory.mktemp("gguf")
    write_gguf(root / "tiny.Q8_0.gguf", "llama", to_gguf("llama", hf_tensors("llama")), Q.Q8_0)
    model, _ = decoded(root / "tiny.Q8_0.gguf")
    folder = root / "folder"
    folder.mkdir()
    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({n: torch.from_numpy(v) for n, v in hf_tensors("llama", seed=1).items()}, folder / "model.safetensors")
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(root / "phi.gguf", "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((256, 4096), np.float32))  # 4 MiB: more than the first read
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"gguf": root / "tiny.Q8_0.gguf", "folder": folder, "phi": root / "phi.gguf"}


@pytest.fixture
def gguf_hub(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.push(REPO, {FILE: files["gguf"].read_bytes(), "README.md": b"# tiny\n",
                     "not-a.gguf": b"PK\x03\x04" + bytes(4096), "phi.gguf": files["phi"].read_bytes()})
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def _merge(tmp_path: Path, gguf_ref: str, folder: Path, out: Path) -> int:
    doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": gguf_ref, "parameters": {"weight": 0.5}}, {"model": str(folder), "parameters": {"weight": 0.5}}]}
    cfg = write_config(tmp_path / f"{out.name}.yml", doc)
    return main(["run", str(cfg), str(out), "--state-dir", str(tmp_path / f"s-{out.name}"), "--quiet"])


def test_a_merge_of_a_hub_gguf_equals_the_merge_of_the_local_file(tmp_path: Path, files: dict[str, Path],
                                                                  gguf_hub: FakeHub) -> None:
    assert _merge(tmp_path, str(files["gguf"]), files["folder"], tmp_path / "local") == 0
    assert _merge(tmp_path, f"{REPO}/{FILE}@main", files["folder"], tmp_path / "hub") == 0
    want, got = digests(tmp_path / "local"), digests(tmp_path / "hub")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert got[name] == want[name], name
    size = files["gguf"].stat().st_size
    served = gguf_hub.file_bytes()
    assert set(served) == {f"{REPO}/{FILE}"}, served
    # The header read by range (a first 64 KiB), then the rest of the file downloaded while merging (the merge reads
    # all of it), starting from the bytes that read brought: every byte served once, all of them verified against
    # the hub's sha256.
    assert served[f"{REPO}/{FILE}"] == size
    gguf_hub.reset_counters()
    assert _merge(tmp_path, f"{REPO}@main/{FILE}", files["folder"], tmp_path / "again") == 0  # the other spelling
    assert gguf_hub.file_bytes() == {}, "a second merge must read the verified cached copy"
    assert digests(tmp_path / "again")["model.safetensors"] == want["model.safetensors"]


@pytest.mark.parametrize(("ref", "message"), [
    (f"{REPO}/missing.Q4_K_M.gguf", f"{REPO}@.* has no file missing.Q4_K_M.gguf"),
    (f"{REPO}/not-a.gguf", "not-a.gguf is not a GGUF file"),
    (f"{REPO}/phi.gguf", "a GGUF of architecture 'phi3', which resumerge cannot map"),
    ("org/no-such-repo/x.Q4_K_M.gguf", "org/no-such-repo"),
])
def test_a_missing_file_a_non_gguf_and_an_unmapped_family_are_one_line_before_any_download(
        tmp_path: Path, files: dict[str, Path], gguf_hub: FakeHub, capsys: pytest.CaptureFixture[str],
        ref: str, message: str) -> None:
    import re

    assert _merge(tmp_path, ref, files["folder"], tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err), err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err  # the error, and its hint
    phi = files["phi"].stat().st_size
    assert gguf_hub.file_bytes().get(f"{REPO}/phi.gguf", 0) < phi // 2, "the file must not be downloaded"
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_hub_split_set_merges_as_its_local_files_and_a_resume_keeps_the_pinned_commit(
        tmp_path: Path, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "split"
    root.mkdir()
    write_gguf(root / "tiny.gguf", "llama", to_gguf("llama", hf_tensors("llama")), Q.Q8_0, split_max_tensors=7)
    parts = sorted(p.name for p in root.glob("tiny-*.gguf"))
    assert len(parts) > 2
    fake = FakeHub()
    fake.push(REPO, {name: (root / name).read_bytes() for name in parts})
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        assert _merge(tmp_path, str(root / parts[0]), files["folder"], tmp_path / "local") == 0
        doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
            {"model": f"{REPO}/{parts[0]}", "parameters": {"weight": 0.5}},
            {"model": str(files["folder"]), "parameters": {"weight": 0.5}}]}
        killed = cli("run", write_config(tmp_path / "hub.yml", doc), tmp_path / "hub", "--state-dir",
                     tmp_path / "s-hub", "--quiet", env={"RESUMERGE_KILL_AT": "after_ledger_commit:1"})
        assert killed.returncode == -9, killed.stderr
        want = digests(tmp_path / "local")["model.safetensors"]
        assert set(fake.file_bytes()) == {f"{REPO}/{name}" for name in parts}
        manifest = json.loads((tmp_path / "hub" / "resumerge-manifest.json").read_text())
        assert re.fullmatch(f"{REPO}@[0-9a-f]{{40}}", manifest["model_dirs"][f"{REPO}/{parts[0]}"])
        # main moves to a broken set: the resume reads the recorded snapshot of the pinned commit, nothing from the hub
        fake.push(REPO, {name: (root / name).read_bytes()[:-1] for name in parts})
        fake.reset_counters()
        assert main(["resume", str(tmp_path / "hub"), "--state-dir", str(tmp_path / "s-hub"), "--quiet"]) == 0
        assert digests(tmp_path / "hub")["model.safetensors"] == want
        assert fake.file_bytes() == {}
        missing = f"{REPO}/tiny-00002-of-{len(parts):05d}.gguf"
        assert _merge(tmp_path, missing, files["folder"], tmp_path / "second") == 2


def _xet_push(fake: FakeHub, data: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit the GGUF through Xet with the unmodified huggingface_hub and hf_xet (the stand-in's ``local://``
    CAS), and leave Xet on in this client, as a current install has it; the stand-in then answers every ``resolve``
    with a redirect to a signed URL, as the Hub sends a Xet file's reads to its CAS bridge."""
    import os
    import sys

    from huggingface_hub import HfApi, constants

    from hub.fakehub_write import HubWriter
    from hub.fakehub_xet import XetCas

    writer = HubWriter.attach(fake)
    writer.add_token("hf_write_alice", "alice", orgs=("org",))
    writer.cas = XetCas(tmp_path / "cas")
    monkeypatch.delenv("HF_HUB_DISABLE_XET")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    monkeypatch.setenv("HF_XET_CACHE", str(Path(os.environ["HF_HOME"]) / "xet"))
    monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", True)
    writer.create_repo(REPO)
    HfApi(endpoint=fake.url, token="hf_write_alice").upload_file(path_or_fileobj=data, path_in_repo=FILE,
                                                                  repo_id=REPO)
    assert fake.xet_hashes, "the file must have gone through Xet"
    fake.signed_uses = 1000


def test_a_hub_gguf_downloaded_in_the_xet_tier_starts_from_its_header_read(
        tmp_path: Path, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Xet on, as a current install has it: the download goes to the signed URL the hub redirects to, as the
    header's read did, and asks only for the bytes past that read."""
    from hub.fakehub import iter_requests

    data = files["gguf"].read_bytes()
    fake = FakeHub()
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        _xet_push(fake, data, tmp_path, monkeypatch)
        fake.reset_counters()
        assert _merge(tmp_path, f"{REPO}/{FILE}", files["folder"], tmp_path / "hub") == 0
        bodies = [(r.path.startswith("/_signed/"), r.range) for r in iter_requests(fake, "GET") if r.sent]
        assert fake.file_bytes() == {f"{REPO}/{FILE}": len(data)}
    assert bodies == [(True, f"bytes=0-{FIRST_READ - 1}"), (True, f"bytes={FIRST_READ}-")], bodies
    assert _merge(tmp_path, str(files["gguf"]), files["folder"], tmp_path / "local") == 0
    assert digests(tmp_path / "hub")["model.safetensors"] == digests(tmp_path / "local")["model.safetensors"]


@pytest.mark.parametrize("tier", ["lfs", "xet"])
def test_a_streamed_hub_gguf_is_read_by_range_checked_against_the_hub_sha256_and_merges_as_the_local_file(
        tmp_path: Path, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    import itertools
    import sqlite3

    from hub.fakehub import iter_requests
    from resumerge import api
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.merge.plan.fetching import DOWNLOAD, STREAM

    assert _merge(tmp_path, str(files["gguf"]), files["folder"], tmp_path / "local") == 0
    data = files["gguf"].read_bytes()
    doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": f"{REPO}/{FILE}", "parameters": {"weight": 0.5}},
        {"model": str(files["folder"]), "parameters": {"weight": 0.5}}]}
    cfg = write_config(tmp_path / "hub.yml", doc)
    fake = FakeHub()
    if tier == "lfs":
        fake.push(REPO, {FILE: data})
    with fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        if tier == "xet":
            _xet_push(fake, data, tmp_path, monkeypatch)
        fake.reset_counters()
        # plan: the header read by range, nothing downloaded, and the disk the run will use counted
        planned = api.estimate(cfg, tmp_path / "hub", settings=api.Settings(state_dir=tmp_path / "s-plan"),
                               probe_size=0, bandwidth="1GB")
        assert isinstance(planned, Estimate)
        assert [(c.file, c.how, c.fetch_bytes) for c in planned.fetch] == [(FILE, DOWNLOAD, len(data))]
        assert planned.downloads[f"{REPO}/{FILE}"].bytes == len(data)
        streaming = api.estimate(cfg, tmp_path / "hub", api.Settings(state_dir=tmp_path / "s-plan",
                                                                     resources=api.Resources(stream_inputs=True)),
                                 probe_size=0, bandwidth="1GB")
        assert isinstance(streaming, Estimate)
        assert [(c.how, c.needed < len(data)) for c in streaming.fetch] == [(STREAM, True)]
        assert streaming.downloads[f"{REPO}/{FILE}"].bytes == 0  # nothing kept on disk
        tight = api.estimate(cfg, tmp_path / "hub", api.Settings(state_dir=tmp_path / "s-plan",
                                                                 resources=api.Resources(max_disk=len(data) // 2)),
                             probe_size=0, bandwidth="1GB")
        assert isinstance(tight, Estimate)
        assert [(c.how, c.reason) for c in tight.fetch] == [(STREAM, "downloading it would exceed --max-disk")]
        assert fake.file_bytes()[f"{REPO}/{FILE}"] == 3 * FIRST_READ, "plan must read the header only"
        fake.reset_counters()
        api.run(cfg, tmp_path / "hub", settings=api.Settings(state_dir=tmp_path / "s-hub",
                                                             resources=api.Resources(stream_inputs=True)))
        bodies = [r for r in iter_requests(fake, "GET") if r.sent]
    want, got = digests(tmp_path / "local"), digests(tmp_path / "hub")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert got[name] == want[name], name
    # Every byte served by range (redirected to signed URLs in the Xet tier), none twice: the tensors the header's
    # first read brought along are not fetched again.
    assert bodies and all(r.range for r in bodies), [(r.path, r.range) for r in bodies]
    assert all(r.path.startswith("/_signed/") for r in bodies) == (tier == "xet")
    spans = sorted((int(a), int(b) + 1) for r in bodies for a, b in [str(r.range)[6:].split("-")])
    assert spans[0][1] == FIRST_READ and all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans
    assert len(data) - 4096 < fake.file_bytes()[f"{REPO}/{FILE}"] <= len(data)
    assert not [p for p in (tmp_path / "hf_home" / "hub").rglob("blobs/*")], "nothing may land in the hub cache"
    ledger = sqlite3.connect(next((tmp_path / "s-hub").glob("hub-*/ledger.db")))
    events = [r[0] for r in ledger.execute("SELECT message FROM events WHERE kind = 'verify'")]
    reads = ledger.execute("SELECT count(*) FROM stream_reads").fetchone()[0]
    ledger.close()
    assert events == [f"{REPO}/{FILE}: every byte streamed, checksum matches the hub's"]
    assert reads > 10  # each tensor's sha256 recorded: a resume compares what it reads again


def test_check_reads_a_hub_gguf_by_range_as_it_reads_the_local_file(tmp_path: Path, files: dict[str, Path],
                                                                     gguf_hub: FakeHub,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    from hub.fakehub import iter_requests
    from resumerge import api
    from resumerge.inputs.hub import integrity

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\n")
    local = api.check(str(files["gguf"]), prompts=prompts, settings=api.Settings(state_dir=tmp_path / "s-local"))
    # The static pass reads the head first, at the file's end: more than a digest holds in memory (as a real
    # model's head is), kept on disk until its turn rather than leaving the file unchecked.
    monkeypatch.setattr(integrity, "MAX_HELD", 4096)
    hub = api.check(f"hf://{REPO}/{FILE}@main", prompts=prompts, settings=api.Settings(state_dir=tmp_path / "s-hub"))
    # A tiny random model alone is judged against the uniform guess only (its NLL is above it: broken); what is
    # tested here is that the hub check reads what the local one reads.
    assert hub.verdict == local.verdict and hub.reasons == local.reasons
    assert local.verdict == "works" or "worse than a guess" in " ".join(local.reasons), local.reasons
    assert hub.to_json()["models"][0]["nll"] == local.to_json()["models"][0]["nll"]
    assert hub.to_json()["static"] == local.to_json()["static"]
    bodies = [r for r in iter_requests(gguf_hub, "GET") if r.sent]
    assert bodies and all(r.range for r in bodies)
    assert not [p for p in (tmp_path / "hf_home" / "hub").rglob("blobs/*")], "nothing may land in the hub cache"
    # Every byte served once (the tensors the header's first read brought along are not fetched again), and the
    # file, read whole, checked against the hub's sha256 (its zero padding counted as known bytes).
    assert gguf_hub.file_bytes()[f"{REPO}/{FILE}"] == files["gguf"].stat().st_size
    journal = sqlite3.connect(next((tmp_path / "s-hub" / "checks").glob("*/hub-reads.db")))
    events = [r[0] for r in journal.execute("SELECT message FROM events WHERE kind = 'verify'")]
    journal.close()
    assert events == [f"{REPO}/{FILE}: every byte read, checksum matches the hub's"]
    assert not list((tmp_path / "s-hub").rglob("early/*")), "what came early is deleted once hashed"
    # Served otherwise than its checksum (one bit of its last tensor): the check stops with exit 4 naming the file,
    # and writes no report.
    data = bytearray(files["gguf"].read_bytes())
    data[-1] ^= 1
    gguf_hub.ranges_from[f"{REPO}/{FILE}"] = bytes(data)
    refused = cli_here("check", f"hf://{REPO}/{FILE}@main", "--prompts", prompts, "--state-dir", tmp_path / "s-bad")
    assert refused.returncode == 4 and f"{REPO}/{FILE}" in refused.stderr and "checksum" in refused.stderr, \
        refused.stderr
    assert not list((tmp_path / "s-bad").rglob("report.json"))


def test_a_gguf_output_of_a_streamed_hub_gguf_equals_the_local_file_s(tmp_path: Path, files: dict[str, Path],
                                                                      gguf_hub: FakeHub) -> None:
    from resumerge import api

    outs = {}
    for name, ref in (("local", str(files["gguf"])), ("hub", f"{REPO}/{FILE}")):
        doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
            {"model": ref, "parameters": {"weight": 0.5}},
            {"model": str(files["folder"]), "parameters": {"weight": 0.5}}]}
        outs[name] = tmp_path / name
        api.run(write_config(tmp_path / f"{name}.yml", doc), outs[name],
                settings=api.Settings(state_dir=tmp_path / f"s-{name}",
                                      output=api.Output(out_type="gguf", gguf_type="q8_0"),
                                      resources=api.Resources(stream_inputs=True)))
    # the tokenizer keys copied from the hub file's header, read by range: the file is never on disk
    assert (outs["hub"] / "model.gguf").read_bytes() == (outs["local"] / "model.gguf").read_bytes()
    assert not [p for p in (tmp_path / "hf_home" / "hub").rglob("blobs/*")]


def test_an_interrupted_streamed_hub_gguf_resumes_by_range_at_its_pinned_commit(
        tmp_path: Path, files: dict[str, Path], gguf_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from hub.fakehub import iter_requests
    from resumerge import api
    from resumerge.machine import killpoints

    shards = api.Output(out_shard_size="1MB")
    outs = {}
    for name, ref in (("local", str(files["gguf"])), ("hub", f"{REPO}/{FILE}")):
        doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
            {"model": ref, "parameters": {"weight": 0.5}},
            {"model": str(files["folder"]), "parameters": {"weight": 0.5}}]}
        outs[name] = write_config(tmp_path / f"{name}.yml", doc)
    api.run(outs["local"], tmp_path / "local", settings=api.Settings(state_dir=tmp_path / "s-local", output=shards))
    commits = 0

    def interrupt(point: str, **_: object) -> None:  # Ctrl-C once the first output shard is committed
        nonlocal commits
        commits += point == "after_ledger_commit"
        if commits == 1 and point == "after_ledger_commit":
            raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(killpoints, "reach", interrupt)
        with pytest.raises(KeyboardInterrupt):
            api.run(outs["hub"], tmp_path / "hub", settings=api.Settings(state_dir=tmp_path / "s-hub", output=shards,
                                                                         resources=api.Resources(stream_inputs=True)))
    pinned = gguf_hub.commit_of(REPO, "main")
    gguf_hub.push(REPO, {FILE: files["gguf"].read_bytes()[:-32]})  # main moves on to a damaged file
    gguf_hub.reset_counters()
    api.resume(tmp_path / "hub", settings=api.Settings(state_dir=tmp_path / "s-hub"))
    want, got = digests(tmp_path / "local"), digests(tmp_path / "hub")
    assert [n for n in want if n.endswith(".safetensors")] and all(
        got[n] == want[n] for n in want if n.endswith((".safetensors", ".json")) and n != "resumerge-manifest.json")
    bodies = [r for r in iter_requests(gguf_hub, "GET") if r.sent]
    assert bodies and all(r.range and f"/resolve/{pinned}/" in r.path for r in bodies), bodies
    assert 0 < gguf_hub.file_bytes()[f"{REPO}/{FILE}"] < files["gguf"].stat().st_size  # the shards left only


def test_a_streamed_hub_gguf_whose_bytes_are_not_the_listed_sha256_stops_the_merge(
        tmp_path: Path, files: dict[str, Path], gguf_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge import api
    from resumerge.inputs.hub.integrity import StreamedInputChanged

    listed = gguf_hub.file_entry

    def lying(path: str, data: bytes) -> dict[str, object]:  # the hub lists another sha256 than it serves
        entry = listed(path, data)
        if path == FILE:
            entry["lfs"] = {**entry["lfs"], "oid": "0" * 64}  # type: ignore[dict-item]
        return entry

    monkeypatch.setattr(gguf_hub, "file_entry", lying)
    doc: dict[str, object] = {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": f"{REPO}/{FILE}", "parameters": {"weight": 0.5}},
        {"model": str(files["folder"]), "parameters": {"weight": 0.5}}]}
    with pytest.raises(StreamedInputChanged, match="does not match the hub's checksum 000000000000"):
        api.run(write_config(tmp_path / "hub.yml", doc), tmp_path / "hub",
                settings=api.Settings(state_dir=tmp_path / "s-hub", resources=api.Resources(stream_inputs=True)))
    assert not (tmp_path / "hub" / "model.safetensors").exists()


def _names_swapped(data: bytes, a: str, b: str) -> bytes:
    """The GGUF ``data`` with the names of tensors ``a`` and ``b`` (of one type and shape, and names of one length)
    swapped in its tensor infos: of the same size and tensor bytes, a header that reads each of them from the
    other's bytes."""
    assert len(a) == len(b)
    at = [data.index(name.encode()) for name in (a, b)]
    out = bytearray(data)
    out[at[0] : at[0] + len(a)], out[at[1] : at[1] + len(b)] = b.encode(), a.encode()
    return bytes(out)


def test_a_downloaded_hub_gguf_whose_header_is_not_the_one_read_by_range_stops_the_merge_before_a_shard(
        tmp_path: Path, files: dict[str, Path], gguf_hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert _merge(tmp_path, str(files["gguf"]), files["folder"], tmp_path / "local") == 0
    data = files["gguf"].read_bytes()
    # The header's range read is served from a stale object; the download is the file the hub lists.
    gguf_hub.ranges_from[f"{REPO}/{FILE}"] = _names_swapped(data, "blk.0.attn_norm.weight", "blk.1.attn_norm.weight")
    capsys.readouterr()
    assert _merge(tmp_path, f"{REPO}/{FILE}", files["folder"], tmp_path / "hub") == 4
    err = capsys.readouterr().err.strip()
    assert f"{REPO}@" in err and f"/{FILE}: the file, verified against the hub's checksum, does not start with the " \
           "header this run was planned from" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "hub" / "model.safetensors").exists(), "no shard may be committed"
    assert gguf_hub.file_bytes()[f"{REPO}/{FILE}"] >= len(data), "the file was downloaded (and verified)"
    # Running again plans from the verified file in the cache: the merge of the local file.
    assert _merge(tmp_path, f"{REPO}/{FILE}", files["folder"], tmp_path / "hub") == 0
    assert digests(tmp_path / "hub")["model.safetensors"] == digests(tmp_path / "local")["model.safetensors"]
