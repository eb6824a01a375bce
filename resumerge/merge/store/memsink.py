"""An output sink that holds its files in a dict: a real sink with no folder or repo behind it.

Like httpx's ``MockTransport``, it is not a stub: it runs the whole sink contract (temp files, publish, receipts,
check, list, delete), so a test or a notebook can run the commit protocol against it and read what was committed
from :attr:`MemorySink.files`. Writers still stream to a local temp file (a shard never sits in RAM while it is
written): publishing reads it into the dict and deletes it.

``batched=True`` makes it commit the way a hub repo does: a published file waits, its receipt unsettled, until
:meth:`MemorySink.flush` or :meth:`MemorySink.stop` commits it together with the newest small files (the manifest)
— so the journal's "committed later" path can be exercised without a hub.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from resumerge.errors import StorageError
from resumerge.machine.checksums import matches, written_with
from resumerge.machine.durable import temp_path
from resumerge.merge.store.sink import OutputSink, Receipt


class MemorySink(OutputSink):
    """OUT as ``files`` (name -> bytes); temp files live under ``scratch`` (a fresh temp folder when None, deleted
    by :meth:`close`)."""

    def __init__(self, files: Mapping[str, bytes] | None = None, *, batched: bool = False,
                 scratch: Path | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.batched = batched
        self.commits = 0  # commits made so far (a batched sink's; one per file otherwise)
        self._owns_scratch = scratch is None
        self.scratch = Path(tempfile.mkdtemp(prefix="resumerge-memsink-")) if scratch is None else scratch
        self._waiting: list[tuple[str, bytes, Receipt]] = []
        self._small: dict[str, bytes] = {}  # small files waiting for the next commit (batched)
        self._lock = threading.Lock()

    def where(self, name: str) -> Path:
        return Path("<memory>") / name

    def temp_for(self, name: str) -> Path:
        return temp_path(self.scratch / name)

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        data = temp.read_bytes()
        temp.unlink()
        if written_with(sha256).of(data) != sha256:
            raise StorageError(f"{name} read back from its temp file differs from what was written", path=str(temp),
                               hint="the scratch folder lost data; check it, then resume")
        with self._lock:
            if self.batched:
                receipt = Receipt(name)
                self._waiting.append((name, data, receipt))
                return receipt
            self.files[name] = data
            self.commits += 1
        return Receipt.committed(name)

    def replace_small(self, name: str, data: bytes) -> None:
        with self._lock:
            if not (self.batched and self._waiting):  # with files waiting, it goes with their commit
                self.files[name] = data
                return
            self._small[name] = data

    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        problems: dict[str, str | None] = {}
        with self._lock:
            for name, size, sha in files:
                data = self.files.get(name)
                if data is None:
                    problems[name] = "missing"
                elif len(data) != size:
                    problems[name] = f"size {len(data)} differs from the committed {size} bytes"
                else:
                    problems[name] = None if matches(data, sha) else "contents differ from the committed checksum"
        return problems

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.files)

    def delete(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                self.files.pop(name, None)

    def flush(self) -> None:
        self._commit()

    def stop(self) -> list[Receipt]:
        return self._commit()

    def close(self) -> None:
        if self._owns_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _commit(self) -> list[Receipt]:
        """Commit every waiting file with the newest small files; returns their receipts, settled."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            small, self._small = self._small, {}
            if not waiting and not small:
                return []
            self.files.update({name: data for name, data, _ in waiting})
            self.files.update(small)
            self.commits += 1
            commit = f"memory-{self.commits}"
        for _, _, receipt in waiting:
            receipt.settle(commit)
        return [receipt for _, _, receipt in waiting]
