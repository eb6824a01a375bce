"""The checksums a run records of its output (issue 87, item 15): a folder's files and units as xxh3-128, each record
naming its algorithm, while every record an earlier version wrote (a bare sha256, in the ledger's rows, its units
and OUT's manifest) keeps verifying, and a run recorded so keeps sha256 when it is resumed, with its ledger or from
OUT's manifest alone. The old records are written here as that version wrote them: the sha256 of the same bytes,
in the same columns and keys."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest
import xxhash
from ggufmodels import linear_llama_config
from support import ReferenceMerge, cli, cli_here, digests, flip_byte, reference_merge

from resumerge.cli.modelgen import ModelSpec
from resumerge.config.locations import run_dir
from resumerge.machine.checksums import SHA256, XXH3_128, check_committed, checksum_of, matches
from resumerge.merge.store.manifest import MANIFEST_NAME
from resumerge.merge.store.units import check_units

SHARD = "100k"


def test_a_record_names_its_algorithm(tmp_path: Path) -> None:
    data = b"resumerge" * 1000
    old = hashlib.sha256(data).hexdigest()
    new = "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)
    assert SHA256.of(data) == old and XXH3_128.of(data) == new  # a sha256 bare, as every record before
    assert checksum_of(old) == SHA256 and checksum_of(new) == XXH3_128
    assert checksum_of("blake3:" + "0" * 64) is None and checksum_of("xxh3-128:abc") is None and checksum_of("") is None
    assert matches(data, old) and matches(data, new) and not matches(data + b"!", new)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert check_committed(tmp_path, "f", len(data), old) is None
    assert check_committed(tmp_path, "f", len(data), new) is None
    assert check_committed(tmp_path, "f", len(data), "blake3:" + "0" * 64) == \
        "its recorded checksum is of no kind this resumerge knows"
    flip_byte(path)
    assert check_committed(tmp_path, "f", len(data), old) == "contents differ from the committed checksum"
    assert check_committed(tmp_path, "f", len(data), new) == "contents differ from the committed checksum"


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    return reference_merge(tmp_path_factory.mktemp("checksums"), ModelSpec(shard_bytes=60_000), SHARD)


def _ledger(out: Path, state: Path) -> Path:
    return run_dir(out, state) / "ledger.db"


def _records(out: Path, state: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The committed files' checksums as the ledger and as OUT's manifest record them."""
    with sqlite3.connect(_ledger(out, state)) as conn:
        rows = dict(conn.execute("SELECT name, sha256 FROM files WHERE status = 'done'").fetchall())
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    return rows, {name: entry["sha256"] for name, entry in manifest["committed"].items()}


def _as_before(out: Path, state: Path | None) -> None:
    """Rewrite every committed record of ``out`` (the ledger's file and unit rows, unless ``state`` is None, and the
    manifest's entries) as the version before issue 87 wrote it: the bare sha256 of the same bytes."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for name, entry in manifest["committed"].items():
        entry["sha256"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if state is None:
        return
    with sqlite3.connect(_ledger(out, state)) as conn:
        for name in [r[0] for r in conn.execute("SELECT name FROM files WHERE status = 'done'")]:
            conn.execute("UPDATE files SET sha256 = ? WHERE name = ?",
                         [hashlib.sha256((out / name).read_bytes()).hexdigest(), name])
        for file, index, start, end in conn.execute('SELECT file, idx, start, "end" FROM units '
                                                    "WHERE status = 'done'").fetchall():
            data = (out / f".{file}.units.part").read_bytes()[start:end]
            conn.execute("UPDATE units SET sha256 = ? WHERE file = ? AND idx = ?",
                         [hashlib.sha256(data).hexdigest(), file, index])


def _shards_and_side_files(found: dict[str, str]) -> dict[str, str]:
    """Every file but the manifest (whose records differ in kind between a run recorded before and one now)."""
    return {name: digest for name, digest in found.items() if name != MANIFEST_NAME}


def test_a_folder_run_records_xxh3_of_each_file_in_the_ledger_and_the_manifest(ref: ReferenceMerge) -> None:
    out, state = ref.killed("new", "after_manifest_write:1", SHARD)
    assert cli_here("resume", out, "--state-dir", state, "--quiet").returncode == 0
    rows, manifest = _records(out, state)
    expected = {name: "xxh3-128:" + xxhash.xxh3_128_hexdigest((out / name).read_bytes())
                for name in ref.reference if name != MANIFEST_NAME}
    assert rows == manifest == expected
    assert digests(out) == ref.reference  # the same manifest as the uninterrupted run's: one kind of record
    flip_byte(out / "model-00002-of-00002.safetensors")
    damaged = cli_here("verify", out, "--state-dir", state, "--json")
    assert damaged.returncode == 3
    assert [d["name"] for d in json.loads(damaged.stdout)["damaged"]] == ["model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("ledger", [True, False], ids=["with-its-ledger", "from-the-manifest-alone"])
def test_a_run_recorded_with_sha256_resumes_with_sha256_and_verifies(ref: ReferenceMerge, ledger: bool) -> None:
    out, state = ref.killed(f"old-{ledger}", "after_manifest_write:1", SHARD)
    _as_before(out, state if ledger else None)
    if not ledger:
        shutil.rmtree(state)  # a runtime reset: OUT's manifest is the only record
    assert cli_here("resume", out, "--state-dir", state, "--quiet").returncode == 0
    rows, manifest = _records(out, state)
    expected = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                for name in ref.reference if name != MANIFEST_NAME}
    assert rows == manifest == expected  # the files this version wrote recorded as the first one was
    assert _shards_and_side_files(digests(out)) == _shards_and_side_files(ref.reference)
    assert cli_here("verify", out, "--state-dir", state).returncode == 0
    first = "model-00001-of-00002.safetensors"  # committed by the run recorded before
    flip_byte(out / first)
    damaged = cli_here("verify", out, "--state-dir", state, "--json")
    assert damaged.returncode == 3 and [d["name"] for d in json.loads(damaged.stdout)["damaged"]] == [first]
    assert cli_here("resume", out, "--state-dir", state, "--quiet").returncode == 0
    assert _shards_and_side_files(digests(out)) == _shards_and_side_files(ref.reference)
    assert _records(out, state)[0][first] == hashlib.sha256((out / first).read_bytes()).hexdigest()


def test_units_recorded_with_sha256_are_kept_by_a_resume_and_checked(tmp_path: Path) -> None:
    config = linear_llama_config(tmp_path)
    flags = ("--out-type", "gguf", "--gguf-type", "q8_0", "--out-shard-size", "500k", "--quiet")
    whole = tmp_path / "whole"
    assert cli_here("run", config, whole, "--state-dir", tmp_path / "whole.state", *flags).returncode == 0
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, *flags, env={"RESUMERGE_KILL_AT": "after_unit_commit:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    _as_before(out, state)
    with sqlite3.connect(_ledger(out, state)) as conn:
        kept = conn.execute("SELECT idx, start, \"end\", sha256 FROM units WHERE status = 'done'").fetchall()
    assert len(kept) == 3 and all(checksum_of(sha) == SHA256 for *_, sha in kept)
    partial = out / ".model.gguf.units.part"
    assert check_units(partial, kept) == dict.fromkeys(range(3))  # the old records check as they were written
    assert cli_here("resume", out, "--state-dir", state, "--quiet").returncode == 0
    assert (out / "model.gguf").read_bytes() == (whole / "model.gguf").read_bytes()
    with sqlite3.connect(_ledger(out, state)) as conn:
        units = conn.execute("SELECT sha256 FROM units WHERE status = 'done'").fetchall()
        (file,) = conn.execute("SELECT sha256 FROM files WHERE name = 'model.gguf'").fetchone()
    assert len(units) > 3 and all(checksum_of(sha) == SHA256 for (sha,) in units)  # kept, and written after
    assert file == hashlib.sha256((out / "model.gguf").read_bytes()).hexdigest()
    assert cli_here("verify", out, "--state-dir", state).returncode == 0
