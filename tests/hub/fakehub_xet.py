"""The Xet side of the stand-in hub: hf_xet's file-backed ``local://`` CAS, read the way the Hub reads its own.

With a :class:`XetCas` attached (``HubWriter.cas``), the stand-in answers ``xet-write-token`` / ``xet-read-token``
with ``casUrl = local://<folder>`` (``shared/reference/hub-real.md`` §2), so the unmodified huggingface_hub and
hf_xet upload through Xet: hf_xet chunks and deduplicates the files and writes xorbs (chunk data) and shards (which
register each file with its sha256) into the folder. Nothing goes through the stand-in's HTTP routes but the token
request and the commit.

A commit's ``lfsFile`` names an object by sha256; the stand-in holds it when a shard in the folder registers that
sha256 (:meth:`XetCas.lookup`), and then rebuilds the bytes through hf_xet (:meth:`XetCas.read`) to keep them with
the commit, so every read route serves Xet-uploaded files as it serves the others, with their ``xetHash``.

What a test measures: :meth:`XetCas.registrations` (how many shards registered an object: one per upload session
that ingested it, deduplicated or not) and :meth:`XetCas.received` (xorb and shard bytes the folder received after
a snapshot: what was actually sent). ``local://`` keeps the client's shard cache and session state inside the
folder too (``xet/shard-cache``, ``xet/shard-session``): :meth:`XetCas.forget_clients` deletes them, which is what a
fresh machine lacks.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_HEADER = 48  # shard header: 32-byte tag, u64 version, u64 footer size
_ENTRY = 48  # every record of a shard's file section is 48 bytes
_BOOKEND = b"\xff" * 32
_WITH_VERIFICATION = 1 << 31
_WITH_METADATA = 1 << 30  # the metadata extension holds the file's sha256
# Client-side state hf_xet keeps inside a local:// CAS folder (a real client keeps it under HF_XET_CACHE).
CLIENT_STATE = ("xet/shard-cache", "xet/shard-session")
_INDEX = "global_dedup_lookup.redb"  # the CAS's index database (hf_xet 1.8: redb), in the xorbs folder


def _hex(raw: bytes) -> str:
    """A Xet hash as hf_xet writes it: the four little-endian u64 words, each printed big-endian."""
    return b"".join(raw[i:i + 8][::-1] for i in range(0, 32, 8)).hex()


def shard_files(data: bytes) -> list[tuple[str, str, int]]:
    """``(sha256, xet hash, size)`` of every file a shard (MDB format v2) registers with its sha256."""
    found: list[tuple[str, str, int]] = []
    pos = _HEADER
    while pos + _ENTRY <= len(data) and data[pos:pos + 32] != _BOOKEND:
        xet_hash = _hex(data[pos:pos + 32])
        flags, count = struct.unpack_from("<II", data, pos + 32)
        pos += _ENTRY
        size = sum(struct.unpack_from("<I", data, pos + i * _ENTRY + 36)[0] for i in range(count))
        pos += count * _ENTRY
        if flags & _WITH_VERIFICATION:
            pos += count * _ENTRY
        if flags & _WITH_METADATA:
            found.append((_hex(data[pos:pos + 32]), xet_hash, size))
            pos += _ENTRY
    return found


def _index_at_one_instant(path: Path) -> bytes | None:
    """The index database's bytes as they were at one instant, while a client may be writing it.

    A copy read while a client commits to the database is torn: hf_xet's redb then panicked opening it ("assertion
    failed: storage.raw_file_len()? >= header.layout().len()", its header naming a longer file), and the panic
    poisoned hf_xet's process-wide table of open databases, so every later ``local://`` read or upload in the
    process failed. Two reads alike, the file's inode, size and mtime unchanged around them, make the second a
    snapshot: the state of a client that stopped there, which redb opens as after a crash. None when there is
    no index (nothing uploaded yet)."""
    for _ in range(1000):
        try:
            before = path.stat()
            first, second = path.read_bytes(), path.read_bytes()
            after = path.stat()
        except FileNotFoundError:
            return None
        same = (before.st_ino, before.st_size, before.st_mtime_ns) == (after.st_ino, after.st_size, after.st_mtime_ns)
        if same and first == second and len(second) == after.st_size:
            return second
        time.sleep(0.005)
    raise AssertionError(f"{path} kept changing while read")


@dataclass
class XetCas:
    """A ``local://`` CAS folder and what the stand-in knows of it."""

    root: Path
    lock: threading.Lock = field(default_factory=threading.Lock)
    _parsed: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)  # shard file -> its files

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"local://{self.root}"

    def _shards(self) -> dict[str, list[tuple[str, str, int]]]:
        with self.lock:
            for path in sorted((self.root / "xet" / "xorbs" / "shards").glob("*.mdb")):
                if path.name not in self._parsed:
                    self._parsed[path.name] = shard_files(path.read_bytes())
            return dict(self._parsed)

    def lookup(self, sha256: str) -> tuple[str, int] | None:
        """The Xet hash and size of the object with this sha256, when a shard registers it."""
        for files in self._shards().values():
            for sha, xet_hash, size in files:
                if sha == sha256:
                    return xet_hash, size
        return None

    def registrations(self) -> dict[str, int]:
        """How many shards registered each object (by sha256): one per upload session that ingested it."""
        counts: dict[str, int] = {}
        for files in self._shards().values():
            for sha in {f[0] for f in files}:
                counts[sha] = counts.get(sha, 0) + 1
        return counts

    def read(self, xet_hash: str, size: int) -> bytes:
        """The bytes of a registered object, rebuilt from its chunks by hf_xet, from a copy of the folder.

        hf_xet opens the ``local://`` folder's index database exclusively: reading the folder itself while a client
        uploads (commits land while the next files upload) made that client's upload fail with "Database already
        open. Cannot acquire lock" — a lock the real CAS does not have. A plain copy takes no lock, but its index
        must be one instant's (:func:`_index_at_one_instant`), copied before the xorbs and shards it names; a copy
        that still cannot rebuild the object (a shard not yet there) is taken again."""
        import hf_xet

        store = self.root / "xet" / "xorbs"
        for _ in range(200):
            with tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / "xet" / "xorbs"
                copy.mkdir(parents=True)
                index = _index_at_one_instant(store / _INDEX)
                if index is not None:
                    (copy / _INDEX).write_bytes(index)
                # hf_xet writes each xorb and shard under a hidden temporary name, then renames it: those are skipped
                # (one renamed while copied failed the copy).
                shutil.copytree(store, copy, ignore=shutil.ignore_patterns(_INDEX, ".*"), dirs_exist_ok=True)
                try:
                    group = hf_xet.XetSession().new_download_stream_group(endpoint=f"local://{tmp}")
                    data = b"".join(group.download_stream(hf_xet.XetFileInfo(xet_hash, size)))
                except RuntimeError as exc:
                    if "PoisonError" in str(exc):  # an earlier panic: every later local:// open here panics too
                        raise AssertionError(f"hf_xet's local:// CAS is unusable in this process: {exc}") from exc
                    data = b""
            if len(data) == size:
                return data
            time.sleep(0.05)
        raise AssertionError(f"the CAS could not rebuild {xet_hash}")

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """``{xorb or shard file: (size, mtime_ns)}`` of what the CAS holds now."""
        store = self.root / "xet" / "xorbs"
        return {p.relative_to(store).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
                for sub in ("xorbs", "shards") for p in sorted((store / sub).glob("*"))
                if p.is_file() and not p.name.endswith((".tagset", ".redb"))}

    def received(self, since: dict[str, tuple[int, int]]) -> dict[str, int]:
        """Bytes the CAS received after ``since``, as ``{"xorbs": n, "shards": n}`` (new or rewritten files)."""
        out = {"xorbs": 0, "shards": 0}
        for name, (size, mtime) in self.snapshot().items():
            if since.get(name) != (size, mtime):
                out[name.split("/")[0]] += size
        return out

    def forget_clients(self) -> None:
        """Delete the client-side state hf_xet keeps in the folder: what a fresh machine does not have."""
        for sub in CLIENT_STATE:
            shutil.rmtree(self.root / sub, ignore_errors=True)
