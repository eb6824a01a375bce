"""The header a hub safetensors input was planned from is held to the verified file: a file downloaded (or found in
the cache) whose header is not the one read by range at plan time (or from a damaged cached copy) stops the run in
one line (exit 4) before a shard is committed, and running the command again plans from the verified file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support import digests, write_config

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model


def swapped(data: bytes) -> bytes:
    """The safetensors file ``data`` with the offsets of two tensors of one dtype and shape swapped in its header:
    of the same size and tensor bytes, a header that reads each of them from the other's bytes. Raises
    ``LookupError`` when no two tensors are alike."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        key = (info["dtype"], tuple(info["shape"]))
        if key in seen:
            other = header[seen[key]]
            info["data_offsets"], other["data_offsets"] = other["data_offsets"], info["data_offsets"]
            raw = json.dumps(header, separators=(",", ":")).encode()
            assert len(raw) <= n
            return data[:8] + raw.ljust(n, b" ") + data[8 + n :]
        seen[key] = name
    raise LookupError("no two tensors of one dtype and shape")


@pytest.mark.parametrize("how", ["download", "cached"])
def test_a_verified_hub_shard_whose_header_is_not_the_planned_one_stops_the_run_before_a_shard_is_committed(
        tmp_path: Path, hub: FakeHub, state: Path, models: tuple[Model, Model], hf_env: Path,
        capsys: pytest.CaptureFixture[str], how: str) -> None:
    shard = next(s for s in models[0].shards if _alike(models[0].files[s]))
    bad = swapped(models[0].files[shard])
    local = make_model(tmp_path / "local", SPEC, seed=7)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": REPO, "parameters": {"weight": 0.5}}, {"model": str(local), "parameters": {"weight": 0.5}}]})
    args = ["--state-dir", str(state), "--quiet"]
    # The ordinary path, whose verified files pass the check: the reference (into its own cache when the faulty
    # run must download).
    own_cache = ["--transformers-cache", str(tmp_path / "ref-cache")] if how == "download" else []
    assert main(["run", str(cfg), str(tmp_path / "ref"), *args, *own_cache]) == 0
    if how == "download":  # the header's range read is served from a stale object, the download is the listed file
        hub.ranges_from[f"{REPO}/{shard}"] = bad
    else:  # the cached copy is damaged, its size kept: the plan reads its header, the run then fetches it again
        blob = next((hf_env / "hub").rglob(f"blobs/{hashlib.sha256(models[0].files[shard]).hexdigest()}"))
        blob.chmod(0o644)
        blob.write_bytes(bad)
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), *args]) == 4
    err = capsys.readouterr().err.strip()
    assert f"/{shard}: the file, verified against the hub's checksum, does not start with the header this run " \
           "was planned from" in err, err
    assert f"{REPO}@" in err and "run the same command again" in err and len(err.splitlines()) == 1, err
    assert not (out.exists() and list(out.glob("*.safetensors"))), "no shard may be committed"
    # Running again plans from the verified file in the cache: the merge of the hub's files.
    assert main(["run", str(cfg), str(out), *args]) == 0
    want, got = digests(tmp_path / "ref"), digests(out)
    assert [n for n in want if n.endswith(".safetensors")]
    assert all(got[n] == want[n] for n in want if n.endswith(".safetensors"))


def _alike(data: bytes) -> bool:
    try:
        swapped(data)
    except LookupError:
        return False
    return True
