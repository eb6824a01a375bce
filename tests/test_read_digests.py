"""The input proof taken in the reads the merge makes anyway (issue 72): a digest per range read, the file's record
the xxh3-128 of its ranges' digests in file order, whoever hashed each range (a unit in its read, the proof for the
ranges no read has hashed); the older forms (merged spans, whole-file sha256) still proved as recorded."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import sqlite3
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import xxhash
from support import linear_config, write_config

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import run_dir
from resumerge.errors import PlanChangedError
from resumerge.inputs.contents import Content, prove_unchanged, record_contents
from resumerge.inputs.readdigests import ReadDigests

SPEC = ModelSpec(layers=2, hidden=64, intermediate=128, vocab=300, shard_bytes=64 << 20)


def _reference(data: bytes, ranges: tuple[tuple[int, int], ...]) -> str:
    """The record of ``ranges`` of ``data``, computed here from its definition."""
    name = xxhash.xxh3_64_hexdigest(repr(ranges).encode())
    return f"xxh3-128r:{name}:" + xxhash.xxh3_128_hexdigest(b"".join(
        xxhash.xxh3_128(data[start:end]).digest() for start, end in sorted(ranges)))


def _file(tmp_path: Path) -> tuple[Path, bytes, tuple[tuple[int, int], ...]]:
    path = tmp_path / "model.safetensors"
    data = random.Random(3).randbytes(1 << 20)
    path.write_bytes(data)
    # Adjacent, overlapping and disjoint ranges, one over 64 MiB's batch boundary of none: sorted as a plan gives them.
    ranges = ((100, 5000), (5000, 9000), (7000, 8000), (300_000, 700_000), (900_000, 1 << 20))
    return path, data, ranges


def _read(reads: ReadDigests, path: Path, start: int, end: int, data: bytes) -> None:
    """What a unit's read gives the proof: ``data`` as the bytes read at ``[start, end)``."""
    hashed = reads.hasher(str(path), start, end)
    if hashed is not None:
        hashed.update(data)
        reads.took(str(path), start, end, hashed)


def _write(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a look that differs, always


def test_the_record_is_the_digest_of_the_ranges_digests_whoever_hashed_them(tmp_path: Path) -> None:
    """Ranges given by the reads out of file order, the rest hashed by the proof, or every one by the proof: the
    same record, equal to one computed from the definition; a range a read gave is not hashed again."""
    path, data, ranges = _file(tmp_path)
    by_proof = record_contents([path], None, reads=ReadDigests({str(path): ranges}))
    mixed = ReadDigests({str(path): ranges}, [(str(path), s, e) for s, e in ranges])
    for start, end in (ranges[3], ranges[0]):  # read out of file order
        _read(mixed, path, start, end, data[start:end])
    assert mixed.hasher(str(path), 10, 20) is None  # no range of the file: not hashed
    assert mixed.left(str(path)) == sum(e - s for s, e in ranges) - 400_000 - 4900
    by_reads = record_contents([path], None, reads=mixed)
    assert by_reads[str(path)].digest == by_proof[str(path)].digest == _reference(data, ranges)
    assert by_reads[str(path)][:2] == (len(data), path.stat().st_mtime_ns)

    wrong = ReadDigests({str(path): ranges})  # what a read gives is what is recorded: never hashed twice
    _read(wrong, path, *ranges[1], b"\x00" * 4000)
    assert record_contents([path], None, reads=wrong)[str(path)].digest != _reference(data, ranges)


def test_the_proof_leaves_the_first_shard_s_ranges_to_the_reads_until_a_commit_asks(tmp_path: Path) -> None:
    """Beside the merge, the proof hashes every range the first shard does not read, then waits: the units hash the
    first shard's as they read them; a commit's ask (need) has the proof hash the rest; a run that ends (stop)
    leaves a proof waiting with nothing recorded."""
    path, data, ranges = _file(tmp_path)
    order = [(str(path), s, e) for s, e in ranges]
    found: dict[str, Content] = {}
    failed: list[BaseException] = []

    def prove(reads: ReadDigests) -> threading.Thread:
        def run() -> None:
            try:
                found.update(record_contents([path], None, reads=reads))
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    reads = ReadDigests({str(path): ranges}, order, order[:2])
    thread = prove(reads)
    thread.join(0.5)
    assert thread.is_alive() and reads.left(str(path)) == 8900  # the first shard's two ranges: left to the reads
    _read(reads, path, *ranges[0], data[ranges[0][0]:ranges[0][1]])
    thread.join(0.3)
    assert thread.is_alive() and reads.left(str(path)) == 4000
    reads.need()
    thread.join(30)
    assert not thread.is_alive() and not failed and found[str(path)].digest == _reference(data, ranges)

    from resumerge.inputs.readdigests import Abandoned

    stopped = ReadDigests({str(path): ranges}, order, order[:2])
    thread = prove(stopped)
    thread.join(0.3)
    stopped.stop()
    thread.join(30)
    assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], Abandoned)


def test_a_file_written_between_its_reads_is_refused(tmp_path: Path) -> None:
    """The look is taken before the first read and again once every range is hashed: a write between a unit's
    read and the proof's is a file that changed while it was read."""
    path, data, ranges = _file(tmp_path)
    reads = ReadDigests({str(path): ranges})
    _read(reads, path, *ranges[0], data[ranges[0][0]:ranges[0][1]])
    _write(path, 400_000, b"\xff" * 8)
    with pytest.raises(PlanChangedError, match="changed while it was being read") as caught:
        record_contents([path], None, reads=reads)
    assert caught.value.path == str(path)


def test_each_form_is_proved_as_recorded(tmp_path: Path) -> None:
    """A ledger's per-range record, its older merged-span record and a whole-file sha256 are each proved in the form
    recorded: a touch proves; an edit outside every range proves the range forms (a sha256 sees it); an edit in a
    range refuses all three, naming the file."""
    path, data, ranges = _file(tmp_path)
    spans = {str(path): [(100, 9000), (300_000, 700_000), (900_000, 1 << 20)]}
    new = record_contents([path], None, reads=ReadDigests({str(path): ranges}))[str(path)]
    old = record_contents([path], None, spans=spans)[str(path)]
    legacy = Content(*new[:3], hashlib.sha256(data).hexdigest())
    assert new.digest.startswith("xxh3-128r:") and old.digest.startswith("xxh3-128:")
    by_form = {"new": new, "old": old, "legacy": legacy}
    rng = {str(path): ranges}

    def proved(form: str) -> dict[str, Content]:
        return prove_unchanged({str(path): by_form[form]}, None, spans=spans, ranges=rng)

    _write(path, 0, data[:8])  # touched, the same bytes
    assert all(proved(form)[str(path)].digest == by_form[form].digest for form in by_form)
    _write(path, 800_000, b"\xff" * 8)  # outside every range
    assert proved("new") and proved("old")
    with pytest.raises(PlanChangedError, match="other bytes"):
        proved("legacy")
    _write(path, 7500, b"\xee" * 8)  # inside two overlapping ranges
    for form in by_form:
        with pytest.raises(PlanChangedError, match="other bytes") as caught:
            proved(form)
        assert caught.value.path == str(path)


def _tensor_ranges(path: Path) -> tuple[tuple[int, int], ...]:
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    return tuple(sorted((8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
                        for k, v in header.items() if k != "__metadata__"))


def test_a_first_run_hashes_in_its_reads_and_the_proof_only_what_they_did_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first local run: its units give the ranges they read to the proof, which starts (here, held until a unit
    has given one) and hashes only the ranges no read has; the ledger holds each file's per-range record, equal to
    one computed from the file's header."""
    from resumerge.inputs import readdigests
    from resumerge.merge.engine import inputcontents

    a, b = make_model(tmp_path / "a", SPEC, seed=1), make_model(tmp_path / "b", SPEC, seed=2)
    config = write_config(tmp_path / "linear.yml", linear_config(a, b))
    given: list[tuple[bool, tuple[int, int]]] = []  # (by the proof, range)
    a_read = threading.Event()
    real_give, real_record = readdigests.ReadDigests._give, inputcontents.record_contents

    def give(self: ReadDigests, f: readdigests._File, indices: Iterable[int], digests: Iterable[bytes]) -> None:
        proof = threading.current_thread().name.startswith("resumerge-contents")
        indices = list(indices)
        given.extend((proof, f.ranges[i]) for i in indices)
        if not proof:
            a_read.set()
        real_give(self, f, indices, digests)

    def after_a_read(*args: object, **kwargs: object) -> object:
        assert a_read.wait(60)
        return real_record(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(readdigests.ReadDigests, "_give", give)
    monkeypatch.setattr(inputcontents, "record_contents", after_a_read)
    out, state = tmp_path / "out", tmp_path / "state"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["run", str(config), str(out), "--state-dir", str(state), "--quiet"]) == 0, err.getvalue()
    files = {str(p): _tensor_ranges(p) for m in (a, b) for p in m.glob("*.safetensors")}
    total = sum(len(r) for r in files.values())
    by_proof = [r for proof, r in given if proof]
    assert any(not proof for proof, _ in given) and len(by_proof) < total
    assert {r for _, r in given} == {r for ranges in files.values() for r in ranges}
    conn = sqlite3.connect(f"file:{run_dir(out, state) / 'ledger.db'}?mode=ro", uri=True)
    try:
        recorded = dict(conn.execute("SELECT path, sha256 FROM input_contents").fetchall())
    finally:
        conn.close()
    assert recorded == {path: _reference(Path(path).read_bytes(), ranges) for path, ranges in files.items()}


def test_small_ranges_are_the_proof_s_read_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range shorter than SMALL is never hashed in a unit's read (no slot, nothing left to the reads for it) and
    the proof reads nearby ones together: the record is the definition's whatever the runs (overlapping, touching,
    a gap wider than a run joins, a run cut at its longest read), and a write between the look and the end is
    refused."""
    from resumerge.inputs import readdigests

    path = tmp_path / "small.safetensors"
    data = random.Random(5).randbytes(1 << 20)
    path.write_bytes(data)
    monkeypatch.setattr(readdigests, "_GAP", 1000)
    monkeypatch.setattr(readdigests, "_BLOCK", 4096)
    small = [(i * 300, i * 300 + 256) for i in range(40)]  # gaps of 44 bytes; runs cut at 4096 bytes
    small += [(100, 400), (200, 300), (12_256, 12_600), (500_000, 500_001), (900_000, 902_047)]  # overlaps, far ones
    ranges = tuple(sorted({*small, (600_000, 600_000 + readdigests.SMALL)}))  # one a unit hashes
    order = [(str(path), s, e) for s, e in ranges]
    reads = ReadDigests({str(path): ranges}, order, order)  # every range the first shard's
    assert reads.hasher(str(path), 100, 400) is None and reads.hasher(str(path), 200, 300) is None
    assert reads.left(str(path)) == sum(e - s for s, e in ranges)
    _read(reads, path, 600_000, 600_000 + readdigests.SMALL, data[600_000:600_000 + readdigests.SMALL])
    assert reads.left(str(path)) == sum(e - s for s, e in small)
    # Nothing left to the reads: the proof needs no commit's ask (it would wait for one otherwise).
    found: dict[str, Content] = {}
    thread = threading.Thread(target=lambda: found.update(record_contents([path], None, reads=reads)))
    thread.start()
    thread.join(30)
    reads.stop()  # a proof still waiting gives up: the assertion below says so
    thread.join(30)
    assert found[str(path)].digest == _reference(data, ranges)

    changed = ReadDigests({str(path): ranges})
    _write(path, 900_500, b"\x01" * 4)
    with pytest.raises(PlanChangedError, match="changed while it was being read"):
        record_contents([path], None, reads=changed)


@pytest.mark.parametrize(("ranges", "asked"), [(((0, 64), (64, 1024)), 0), (((0, 64), (64, 4096)), 2)])
def test_reads_ask_the_proof_only_where_a_read_may_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        ranges: tuple[tuple[int, int], ...], asked: int) -> None:
    """Where every range is shorter than SMALL (a model of tiny tensors: 180k reads at 90k tensors) no read may hash
    one, so the sources never ask the proof (issue 87 item 15: two calls and a path lookup a read); where one is
    long enough, every read asks, and the record is the same either way."""
    from resumerge.inputs import readdigests
    from resumerge.inputs.source import InputSources

    path = tmp_path / "model.safetensors"
    data = random.Random(5).randbytes(8192)
    path.write_bytes(data)
    reads = ReadDigests({str(path): ranges})
    calls: list[tuple[int, int]] = []
    hasher = readdigests.ReadDigests.hasher

    def counted(self: ReadDigests, p: str, start: int, end: int) -> xxhash.xxh3_128 | None:
        calls.append((start, end))
        return hasher(self, p, start, end)

    monkeypatch.setattr(readdigests.ReadDigests, "hasher", counted)
    sources = InputSources.local({"m": str(tmp_path)}).with_proof(lambda _: True, reads)
    for start, end in ranges:
        assert bytes(sources.read("m", path.name, start, end, "U8", (end - start,)).numpy()) == data[start:end]
    assert len(calls) == asked
    reads.hash_rest(path, lambda p: PlanChangedError(str(p)))
    assert reads.digest(path, lambda: PlanChangedError(str(path)))[2] == _reference(data, ranges).rsplit(":", 1)[1]
