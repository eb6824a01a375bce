"""An input re-saved between a kill and a resume (issue 60): a resume, and a `run` that continues the run, prove every
local input file holds the bytes it held when the run started, or refuse (exit 4) naming the file.

The plan's identity of a weight file samples 16 blocks of 64 KiB; these edits fall between the samples, where only
the content proof (a digest of the ranges the plan reads, recorded when the run started, checked when a file looks
different: here the whole model is merged, so every tensor is read) sees them. A
file that only looks different (``touch``) is proved unchanged and the resume ends byte-identical.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import random
import sqlite3
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from support import ReferenceMerge, digests, reference_merge

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec
from resumerge.config.locations import run_dir
from resumerge.inputs.files import file_identity

# One 12 MB input file per model: its 16 sampled blocks leave gaps of about 700 KB, inside the layers' tensors.
SPEC = ModelSpec(layers=4, hidden=256, intermediate=512, vocab=1000, shard_bytes=64 << 20)
SHARD = "2M"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    merge = reference_merge(tmp_path_factory.mktemp("contents"), SPEC, SHARD)
    assert sum(n.startswith("model-") for n in merge.reference) >= 5, "the scenarios need several output shards"
    return merge


def _weights(setup: ReferenceMerge) -> Path:
    (path,) = setup.a.glob("*.safetensors")
    return path


def _gap(path: Path) -> tuple[int, int]:
    """A byte range of ``path``'s tensor data that none of file_identity's sampled blocks touches (mid-file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    block = 64 * 1024
    starts = [(size - block) * k // 15 for k in range(16)]
    gaps = [(a + block, b) for a, b in itertools.pairwise(starts) if a + block >= data_start and b - a > 2 * block]
    start, end = gaps[len(gaps) // 2]
    return start + 16, end - 16


def _killed(setup: ReferenceMerge, name: str) -> tuple[Path, Path]:
    """OUT and state dir of a run SIGKILLed after its 3rd manifest write (shards committed, more to come)."""
    out, state = setup.killed(name, "after_manifest_write:3", SHARD)
    assert any(n.startswith("model-") for n in _committed(out, state)), "the kill came before any shard"
    return out, state


def _committed(out: Path, state: Path) -> dict[str, str]:
    conn = sqlite3.connect(f"file:{run_dir(out, state) / 'ledger.db'}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT name, sha256 FROM files WHERE status = 'done'").fetchall())
    finally:
        conn.close()


def _continue(how: str, setup: ReferenceMerge, out: Path, state: Path) -> subprocess.CompletedProcess[str]:
    """``resume`` OUT, or ``run`` the same config into it again (which continues the run), in this process."""
    args = ["resume", str(out)] if how == "resume" else ["run", str(setup.config), str(out), "--out-shard-size",
                                                         SHARD]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*args, "--state-dir", str(state), "--quiet"])
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def _refused(done: subprocess.CompletedProcess[str], victim: Path) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert str(victim) in lines[0] and "other bytes" in lines[0], lines[0]


def _rewrite_gap(path: Path) -> None:
    """Tensors redrawn and re-saved: every byte of a gap between samples replaced, the file's size unchanged."""
    start, end = _gap(path)
    noise = random.Random(60).randbytes(end - start)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(noise)


def _flip_one_byte(path: Path) -> None:
    start, end = _gap(path)
    with open(path, "r+b") as f:
        f.seek((start + end) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _flip_keeping_mtime(path: Path) -> None:
    st = path.stat()
    _flip_one_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back: only the ctime shows the write


EDITS: dict[str, Callable[[Path], None]] = {
    "tensors-rewritten": _rewrite_gap, "one-byte": _flip_one_byte, "one-byte-mtime-kept": _flip_keeping_mtime}


@pytest.mark.parametrize("how", ["resume", "run"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_input_edited_between_kill_and_resume_is_refused(setup: ReferenceMerge, edit: str, how: str) -> None:
    """The edit is invisible to the plan's identity, so the fingerprint matches; the content proof refuses the run,
    naming the file, and writes nothing; with the file restored the run finishes byte-identical."""
    out, state = _killed(setup, f"{edit}-{how}")
    victim = _weights(setup)
    saved = victim.read_bytes()
    header = saved[:8 + struct.unpack("<Q", saved[:8])[0]]
    before = file_identity(victim, header)
    committed, on_disk = _committed(out, state), digests(out)
    try:
        EDITS[edit](victim)
        assert victim.read_bytes() != saved and victim.stat().st_size == len(saved)
        assert file_identity(victim, header) == before, "the edit must fall between the sampled blocks"
        _refused(_continue(how, setup, out, state), victim)
        assert _committed(out, state) == committed and digests(out) == on_disk, "a refused run wrote something"
    finally:
        victim.write_bytes(saved)
    done = _continue(how, setup, out, state)
    assert done.returncode == 0, done.stderr
    assert digests(out) == setup.reference


@pytest.mark.parametrize("how", ["resume", "run"])
def test_an_input_only_touched_is_proved_unchanged(setup: ReferenceMerge, how: str) -> None:
    """A new mtime (and ctime) with the same bytes is no reason to refuse: the file is hashed again, found equal,
    and the run finishes byte-identical to an uninterrupted one."""
    out, state = _killed(setup, f"touched-{how}")
    victim = _weights(setup)
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    done = _continue(how, setup, out, state)
    assert done.returncode == 0, done.stderr
    assert digests(out) == setup.reference


def test_an_input_rewritten_while_the_merge_is_planned_is_refused(setup: ReferenceMerge, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Tensors re-saved after the plan opened the file (its header and samples as before) and before the run
    hashes it: the plan describes bytes that are gone, so the run is refused before a shard is written."""
    from resumerge.merge.engine import session
    from resumerge.merge.plan.planner import build_plan as planned

    victim = _weights(setup)
    saved = victim.read_bytes()

    def planning_while_saved(*args: object, **kwargs: object) -> object:
        _rewrite_gap(victim)
        return planned(*args, **kwargs)  # type: ignore[arg-type]

    out, state = setup.root / "out-while-planned", setup.root / "state-while-planned"
    monkeypatch.setattr(session, "build_plan", planning_while_saved)
    try:
        done = _continue("run", setup, out, state)
    finally:
        victim.write_bytes(saved)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 4 and len(lines) == 1, done.stderr
    assert str(victim) in lines[0] and "while the merge was being planned" in lines[0], lines[0]
    assert not out.exists() or not any(out.glob("*.safetensors")), "a shard was written from a changed input"


def test_a_file_s_spans_are_read_through_a_buffer_no_larger_than_the_largest(tmp_path: Path) -> None:
    """The proof's reader holds no more than the largest span it reads (8 MiB at most): its threads hash a run's
    last ranges beside its last units, and each held 8 MiB for a small file, what a GGUF run at its smallest budget
    peaked over it by (427 MB under 438 MB now, 444 MB before)."""
    import tracemalloc

    from resumerge.inputs.looks import group_digests

    path = tmp_path / "small.bin"
    path.write_bytes(random.Random(2).randbytes(300_000))
    tracemalloc.start()
    try:
        _, found = group_digests(path, {0: [(0, 100_000)], 1: [(100_000, 300_000)]})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = path.read_bytes()
    assert found == {0: xxhash.xxh3_128_hexdigest(data[:100_000]), 1: xxhash.xxh3_128_hexdigest(data[100_000:])}
    assert peak < 1_000_000, peak


def test_a_digest_is_reused_while_the_file_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merging the same local models again hashes nothing: the state dir's records vouch for a file whose size and
    mtime are as hashed and that was not written or replaced since; a file written since is hashed again."""
    from resumerge.inputs import contents, looks
    from resumerge.inputs.hub import records

    monkeypatch.setattr(records, "RACY_WINDOW_NS", 0)  # a file written a moment ago counts as settled
    monkeypatch.setattr(looks, "RACY_WINDOW_NS", 0)  # the one reader of input spans (inputs.looks.hash_spans)
    weights, state = tmp_path / "model.safetensors", tmp_path / "state"
    weights.write_bytes(random.Random(1).randbytes(1 << 20))
    first = contents.record_contents([weights], state)
    assert first[str(weights)].digest.endswith(":" + xxhash.xxh3_128_hexdigest(weights.read_bytes()))

    def hashed(job: tuple[Path, object]) -> tuple[contents.Content, int]:
        raise AssertionError(f"{job[0]} hashed again")

    monkeypatch.setattr(contents, "_hash", hashed)
    assert contents.record_contents([weights], state) == first
    st = weights.stat()
    with open(weights, "r+b") as f:  # one byte, the mtime set back: the ctime still shows the write
        f.seek(1 << 19)
        f.write(b"\x00")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(records, "RACY_WINDOW_NS", 2_000_000_000)  # as released: a write this recent is never vouched
    with pytest.raises(AssertionError, match="hashed again"):
        contents.record_contents([weights], state)


def _first_run(setup: ReferenceMerge, name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A first ``run`` of the setup's merge into a new OUT and state dir, in this process: OUT and what it ended in."""
    out, state = setup.root / f"out-{name}", setup.root / f"state-{name}"
    args = ["run", str(setup.config), str(out), "--out-shard-size", SHARD, "--state-dir", str(state), "--quiet"]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(args)
    return out, subprocess.CompletedProcess(args, code, "", err.getvalue())


def test_a_first_run_proves_its_inputs_beside_its_first_units_and_commits_no_shard_before(
        setup: ReferenceMerge, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first local run hashes its inputs while its first units compute (not before them): every shard's ledger row
    comes after the digests it was computed from, and the output is the one a proof taken first gave."""
    import threading

    from resumerge.merge.engine import inputcontents
    from resumerge.merge.engine.compute import TensorCompute
    from resumerge.merge.store.ledger import Ledger

    hashed, whole, file_commit = inputcontents.record_contents, TensorCompute.whole, Ledger.commit_file
    unit = threading.Event()
    beside: list[bool] = []
    commits: list[bool] = []

    def after_a_unit(*args: object, **kwargs: object) -> object:
        beside.append(unit.wait(60))  # a proof taken before the merge would wait in vain
        return hashed(*args, **kwargs)  # type: ignore[arg-type]

    def computed(self: TensorCompute, *args: object, **kwargs: object) -> object:
        unit.set()
        return whole(self, *args, **kwargs)  # type: ignore[arg-type]

    def commit_file(self: Ledger, name: str, **kwargs: object) -> None:
        commits.append(bool(self.input_contents()))
        file_commit(self, name, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inputcontents, "record_contents", after_a_unit)
    monkeypatch.setattr(TensorCompute, "whole", computed)
    monkeypatch.setattr(Ledger, "commit_file", commit_file)
    out, done = _first_run(setup, "proved-beside")
    assert done.returncode == 0, done.stderr
    assert beside == [True], "the merge's units waited for the proof"
    assert commits and all(commits), "a file was committed before the inputs' digests were recorded"
    assert digests(out) == setup.reference


def test_a_first_run_whose_proof_fails_publishes_no_shard(setup: ReferenceMerge,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof taken beside the first units finds a file changed while it was read: the run stops with that error
    (exit 4, one line naming the file) and no shard computed meanwhile reaches OUT."""
    import time

    from resumerge.errors import PlanChangedError
    from resumerge.merge.engine import inputcontents

    victim = _weights(setup)

    def changed(*args: object, **kwargs: object) -> object:
        time.sleep(0.5)
        raise PlanChangedError(f"input file {victim} changed while it was being read; nothing was merged from it",
                               path=str(victim))

    monkeypatch.setattr(inputcontents, "record_contents", changed)
    out, done = _first_run(setup, "proof-failed")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 4 and len(lines) == 1 and str(victim) in lines[0], done.stderr
    assert not any(out.glob("model-*.safetensors")), "a shard was published before its inputs were proved"


def test_a_proof_beside_torch_s_import_reads_only_once_the_import_has_ended() -> None:
    """Beside torch's import the proof's reads slowed both (the first unit waits for the import): the proof taken
    beside the first units starts once the import thread has ended, and the commits wait for it as before."""
    import threading

    from resumerge.inputs.contents import Content
    from resumerge.merge.engine.inputcontents import Proving
    from resumerge.merge.store.ledger import Ledger

    importing, release = threading.Event(), threading.Event()
    hashed_while: list[bool] = []
    thread = threading.Thread(target=lambda: (importing.set(), release.wait(60)))
    thread.start()
    importing.wait(60)

    def hashed() -> dict[str, Content]:
        hashed_while.append(thread.is_alive())
        return {}  # nothing to record: the ledger is never written

    proving = Proving(hashed, Ledger.__new__(Ledger), after=thread)
    assert not proving.checked(0.3) and hashed_while == []
    release.set()
    assert proving.checked(60) and hashed_while == [False]
