"""The input proof costs what the plan reads (issue 72): a local input is proved by the byte ranges the plan's units
read of it, so a slice's unread layers are never hashed, and a resume proves exactly those ranges — an edit in a
range a unit still to come reads is refused (exit 4, the file named), an edit in a range no unit reads is said in
one line and the run finishes byte-identical.

The model's weights are one file: the two edits below are inside it, between the plan identity's sampled blocks, so
only the content proof can tell them apart (the whole-file sha256 before this refused both).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sqlite3
import struct
import subprocess
from pathlib import Path

import pytest
from support import ReferenceMerge, digests, write_config

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import run_dir
from resumerge.inputs.files import file_identity

SPEC = ModelSpec(layers=6, hidden=128, intermediate=256, vocab=500, shard_bytes=64 << 20)
SHARD = "200k"
KEPT = 3  # layers 0-2 of 6 are merged: layers 3-5 of each file are never read


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    root = tmp_path_factory.mktemp("ranges")
    a, b = make_model(root / "a", SPEC, seed=1), make_model(root / "b", SPEC, seed=2)
    config = write_config(root / "slice.yml", {"merge_method": "linear", "slices": [{"sources": [
        {"model": str(a), "layer_range": [0, KEPT], "parameters": {"weight": 0.3}},
        {"model": str(b), "layer_range": [0, KEPT], "parameters": {"weight": 0.7}}]}]})
    assert _main("run", config, root / "reference", "--state-dir", root / "ref-state",
                 "--out-shard-size", SHARD).returncode == 0
    reference = digests(root / "reference")
    assert sum(n.startswith("model-") for n in reference) >= 4, "the scenarios need several output shards"
    return ReferenceMerge(root, config, a, reference)


def _main(*args: str | Path) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _weights(setup: ReferenceMerge) -> Path:
    (path,) = setup.a.glob("*.safetensors")
    return path


def _tensors(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's absolute [start, end) in ``path``."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__"}


def _killed(setup: ReferenceMerge, name: str) -> tuple[Path, Path, dict[str, str]]:
    """OUT, state dir and the status of each output tensor of a run SIGKILLed after its 2nd manifest write."""
    out, state = setup.killed(name, "after_manifest_write:2", SHARD)
    conn = sqlite3.connect(f"file:{run_dir(out, state) / 'ledger.db'}?mode=ro", uri=True)
    try:
        status = dict(conn.execute("SELECT name, status FROM tensors").fetchall())
    finally:
        conn.close()
    assert "done" in status.values() and "pending" in status.values(), status
    return out, state, status


def _edit_inside(path: Path, span: tuple[int, int]) -> None:
    """Invert a few bytes in the middle of ``span``, where none of file_identity's sampled blocks falls."""
    raw = path.read_bytes()
    header = raw[:8 + struct.unpack("<Q", raw[:8])[0]]
    before = file_identity(path, header)
    block, size = 64 * 1024, len(raw)
    samples = [(size - block) * k // 15 for k in range(16)]
    middle = next(at for at in range((span[0] + span[1]) // 2, span[1] - 8)
                  if all(not (s <= at < s + block) for s in samples))
    with open(path, "r+b") as f:
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in raw[middle:middle + 8]))
    assert file_identity(path, header) == before, "the edit must fall between the sampled blocks"


def test_an_edit_no_unit_reads_is_said_and_the_run_finishes(setup: ReferenceMerge) -> None:
    """Bytes of layer 5 (outside the slice) re-drawn between kill and resume: no unit reads them, so the output does
    not depend on them; the resume says the file was modified outside what it reads and ends byte-identical."""
    out, state, _ = _killed(setup, "unread")
    victim = _weights(setup)
    saved = victim.read_bytes()
    try:
        _edit_inside(victim, _tensors(victim)["model.layers.5.mlp.down_proj.weight"])
        done = _main("resume", out, "--state-dir", state)
    finally:
        victim.write_bytes(saved)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    line = next(x for x in said.splitlines() if "touched since the run started" in x)
    assert "in every range this merge reads" in line and str(victim.parent) in line, line
    assert digests(out) == setup.reference


def test_an_edit_a_later_unit_reads_is_refused(setup: ReferenceMerge) -> None:
    """Bytes of a tensor whose output is not committed yet re-drawn between kill and resume: the resume would merge
    the rest of the run from other bytes than the digest recorded before the first commit: refused, exit 4, the
    file named, nothing written; restored, the resume ends byte-identical."""
    out, state, status = _killed(setup, "later")
    victim = _weights(setup)
    later = next(name for name, s in sorted(status.items()) if s == "pending" and ".layers." in name)
    saved, on_disk = victim.read_bytes(), digests(out)
    try:
        _edit_inside(victim, _tensors(victim)[later])
        done = _main("resume", out, "--state-dir", state, "--quiet")
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 4, done.stderr
        assert len(lines) == 1 and str(victim) in lines[0] and "other bytes" in lines[0], lines
        assert digests(out) == on_disk, "a refused resume wrote something"
    finally:
        victim.write_bytes(saved)
    assert _main("resume", out, "--state-dir", state, "--quiet").returncode == 0
    assert digests(out) == setup.reference


def test_a_slice_hashes_only_the_ranges_it_reads(setup: ReferenceMerge, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof reads the ranges the plan reads of each file, never a layer outside the slice: the bytes hashed
    are exactly the tensors of layers 0-2 and outside the layers, of each model."""
    from resumerge.inputs import contents, looks
    from resumerge.inputs.hub import records

    monkeypatch.setattr(records, "RACY_WINDOW_NS", 0)  # a file written a moment ago counts as settled
    monkeypatch.setattr(looks, "RACY_WINDOW_NS", 0)  # the one reader of input spans (inputs.looks.hash_spans)
    hashed: list[tuple[Path, tuple[tuple[int, int], ...] | None]] = []
    real = contents._hash

    def spy(job: tuple[Path, tuple[tuple[int, int], ...] | None]) -> tuple[contents.Content, int]:
        hashed.append(job)
        return real(job)

    monkeypatch.setattr(contents, "_hash", spy)
    out, state = setup.root / "out-spans", setup.root / "state-spans"
    assert _main("run", setup.config, out, "--state-dir", state, "--out-shard-size", SHARD).returncode == 0
    victim = _weights(setup)
    tensors = _tensors(victim)
    read = sum(e - s for name, (s, e) in tensors.items()
               if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < KEPT)
    ((_, spans),) = [job for job in hashed if job[0] == victim]
    assert spans is not None and sum(e - s for s, e in spans) == read < victim.stat().st_size * 0.75
    assert all(not (s < tensors["model.layers.4.self_attn.q_proj.weight"][1] and
                    e > tensors["model.layers.4.self_attn.q_proj.weight"][0]) for s, e in spans)
    hashed.clear()  # the same files again, in a new OUT: the state dir's records vouch for them
    assert _main("run", setup.config, setup.root / "out-spans2", "--state-dir", state,
                 "--out-shard-size", SHARD).returncode == 0
    assert hashed == []
    assert digests(out) == digests(setup.root / "out-spans2") == setup.reference


def test_the_proof_covers_its_spans_and_a_ledger_of_whole_file_sha256_still_proves(tmp_path: Path) -> None:
    """Unit rules, without a run: a file read nowhere (no spans) is proved by nothing it holds; an edit inside a span
    is refused, one outside it is not; a record made before the per-range rule (a whole-file sha256) is proved as it
    was recorded, so an edit anywhere in that file is still refused."""
    from resumerge.errors import PlanChangedError
    from resumerge.inputs.contents import Content, prove_unchanged, record_contents

    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    spans = {str(path): [(1000, 2000), (500_000, 600_000)]}
    unread = tmp_path / "unread.safetensors"
    unread.write_bytes(b"x" * 4096)
    recorded = record_contents([path, unread], None, spans={**spans, str(unread): []})
    legacy = Content(*recorded[str(path)][:3], hashlib.sha256(path.read_bytes()).hexdigest())

    def write(at: int, data: bytes, target: Path = path) -> None:
        with open(target, "r+b") as f:
            f.seek(at)
            f.write(data)
        st = target.stat()
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a look that differs, always

    write(0, b"\xff" * 8, unread)
    write(300_000, b"\xff" * 8)  # outside both spans
    again = prove_unchanged(recorded, None, spans={**spans, str(unread): []})
    assert set(again) == {str(path), str(unread)}  # both touched, both proved
    with pytest.raises(PlanChangedError, match="other bytes"):
        prove_unchanged({str(path): legacy}, None, spans=spans)  # the whole file was recorded: the edit counts
    write(550_000, b"\x00" * 8)  # inside the second span
    with pytest.raises(PlanChangedError, match="other bytes"):
        prove_unchanged(recorded, None, spans=spans)
