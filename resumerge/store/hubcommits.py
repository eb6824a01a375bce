"""Uploads and batched commits to a hub repo, in the background, with retries.

Each published file is uploaded at once on a small thread pool (``preupload_lfs_files``: the LFS batch API tells
which objects the hub already has, and those are never sent again), while the engine computes the next files.
A committer thread turns uploaded files into commits (``create_commit``) by count (``every`` files) and by time
(``interval`` seconds since the oldest waiting file), always together with the newest manifest that lists exactly
the committed files plus that batch — so the repo's manifest never names a file the repo lacks. A commit counts
only when the hub answered it; the staged copies are deleted after that, and :meth:`CommitQueue.settled` hands
the committed names (with the commit id) to the caller, which writes the ledger rows.

429, 5xx and network errors are retried with exponential backoff (``Retry-After`` honoured); a commit whose
answer was lost is recognised from the tree listing instead of being sent twice. Commits are paced to at most
``Batching.hourly`` in any hour, under the hub's 128 commits per repo and hour.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from resumerge.errors import ResumergeError
from resumerge.store import killpoints
from resumerge.store.durable import discard
from resumerge.store.hubaccess import HubRepo, git_blob_sha1, hub_failure, is_retryable, remote_files
from resumerge.store.manifest import MANIFEST_NAME
from resumerge.store.sink import Settled

T = TypeVar("T")
ATTEMPTS = 6
BASE_WAIT = 1.0
MAX_WAIT = 60.0


# The hub allows 128 commits per repo and hour ("You have exceeded the rate limit for repository commits (128 per
# hour)"). This process makes at most HOURLY_COMMITS in any hour, leaving room for retries and other writers.
HOURLY_COMMITS = 100
WINDOW = 3600.0


@dataclass(frozen=True)
class Batching:
    """When to commit: once ``every`` uploaded files wait, or ``interval`` seconds after the oldest waiting one."""

    every: int = 20
    interval: float = 60.0
    hourly: int = HOURLY_COMMITS  # commits allowed in any hour; a commit beyond it waits for the window to move


@dataclass
class _Entry:
    name: str
    path: Path
    sha256: str
    size: int
    op: CommitOperationAdd
    since: float
    upload: Future[None] | None = None


@dataclass
class _State:
    entries: list[_Entry] = field(default_factory=list)  # published, not committed, in publish order
    manifest: tuple[bytes, int] | None = None  # newest manifest and how many entries it covers
    committed_manifest: bytes | None = None
    settled: list[Settled] = field(default_factory=list)
    error: BaseException | None = None
    urgent: bool = False  # staged bytes are over --max-disk: commit what is ready without waiting for a full batch
    draining: bool = False  # the run's last files: commit at once
    closed: bool = False


def with_retries(repo: HubRepo, what: str, call: Callable[[], T], *, resume: str,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, retried on 429/5xx/network errors with exponential backoff (``Retry-After`` wins when sent).

    Raises the exit-3 error of :func:`~resumerge.store.hubaccess.hub_failure` when it keeps failing or the token
    is refused.
    """
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except Exception as exc:
            if not is_retryable(exc) or attempt == ATTEMPTS - 1:
                raise hub_failure(repo, what, exc, resume=resume) from exc
            sleep(_wait(exc, attempt))
    raise AssertionError("unreachable")


def _wait(exc: BaseException, attempt: int) -> float:
    """Seconds to wait before the next attempt: the server's ``Retry-After`` (seconds form) when it sent one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    header = str(headers.get("Retry-After", "")) if headers is not None else ""
    if header.strip().isdigit():
        return min(float(header), MAX_WAIT)
    return float(min(BASE_WAIT * 2**attempt, MAX_WAIT))


class CommitQueue:
    """The background uploads and commits of one run into one repo."""

    def __init__(self, repo: HubRepo, batching: Batching, *, resume: str, uploads: int = 2) -> None:
        self.repo, self.batching, self.resume = repo, batching, resume
        self.state = _State()
        self.cond = threading.Condition()
        self.commit_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=uploads, thread_name_prefix="resumerge-upload")
        self.commits = 0
        self.recent: deque[float] = deque()  # when this process's commits of the last hour were made
        self.thread = threading.Thread(target=self._loop, name="resumerge-committer", daemon=True)
        self.thread.start()

    # ---- the engine's side -------------------------------------------------------------------------------
    def add(self, name: str, path: Path, sha256: str, size: int) -> None:
        """Take over the staged file ``path`` (``name`` in the repo) and start uploading it."""
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
        op.upload_info.sha256 = bytes.fromhex(sha256)  # known already: the client need not hash it again
        entry = _Entry(name, path, sha256, size, op, time.monotonic())
        with self.cond:
            self._raise_error()
            self.state.entries.append(entry)
        entry.upload = self.pool.submit(self._upload, entry)
        entry.upload.add_done_callback(lambda _: self._notify())

    def set_manifest(self, data: bytes) -> None:
        """The newest manifest: committed with the next batch, or at once when no file is waiting."""
        with self.cond:
            self._raise_error()
            self.state.manifest = (data, len(self.state.entries))
            waiting = bool(self.state.entries)
            self.cond.notify_all()
        if not waiting:
            self._commit_now([])

    def wait_room(self, limit: int) -> None:
        """Block until the staged, uncommitted bytes are at most ``limit`` (or none are staged), committing early."""
        with self.cond:
            while self.state.entries and sum(e.size for e in self.state.entries) > limit:
                self._raise_error()
                self.state.urgent = True
                self.cond.notify_all()
                self.cond.wait(timeout=0.5)
            self._raise_error()

    def settled(self) -> list[Settled]:
        with self.cond:
            self._raise_error()
            done, self.state.settled = self.state.settled, []
            return done

    def drain(self) -> list[Settled]:
        """Commit every waiting file and the newest manifest; return what was not yet returned by settled()."""
        with self.cond:
            covered = self.state.manifest[1] if self.state.manifest else 0
            if covered < len(self.state.entries):
                raise ResumergeError("internal: files were published without a manifest that lists them")
            while self.state.entries:
                self._raise_error()
                self.state.draining = True
                self.cond.notify_all()
                self.cond.wait(timeout=0.5)
            pending = self.state.manifest is not None and self.state.manifest[0] != self.state.committed_manifest
        if pending:
            self._commit_now([])
        return self.settled()

    def delete(self, names: list[str]) -> None:
        """Delete ``names`` from the repo in one commit, with the newest manifest. Only before files are published
        (reconcile and ``--restart`` clean up before the engine writes)."""
        with self.cond:
            if self.state.entries:
                raise ResumergeError("internal: a delete while files wait for their commit")
        self._commit_now([CommitOperationDelete(path_in_repo=n) for n in names])

    def close(self) -> None:
        with self.cond:
            self.state.closed = True
            self.cond.notify_all()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.thread.join(timeout=30)

    # ---- background ------------------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _raise_error(self) -> None:
        if self.state.error is not None:
            raise self.state.error

    def _upload(self, entry: _Entry) -> None:
        api = self.repo.api()
        try:
            with_retries(self.repo, f"uploading {entry.name}", lambda: api.preupload_lfs_files(
                self.repo.target.repo_id, additions=[entry.op], revision=self.repo.target.branch,
                free_memory=False), resume=self.resume)
        except BaseException as exc:
            with self.cond:
                self.state.error = self.state.error or exc
                self.cond.notify_all()
            raise
        killpoints.reach("hub_after_upload")

    def _loop(self) -> None:
        while True:
            with self.cond:
                batch = self._due()
                while batch is None and not self.state.closed and self.state.error is None:
                    self.cond.wait(timeout=self._timeout())
                    batch = self._due()
                if self.state.closed or self.state.error is not None or batch is None:
                    return
                entries, manifest = batch
            try:
                self._commit(entries, manifest)
            except BaseException as exc:
                with self.cond:
                    self.state.error = self.state.error or exc
                    self.cond.notify_all()
                return

    def _timeout(self) -> float:
        entries = self.state.entries
        if not entries:
            return 1.0
        return max(0.05, min(1.0, entries[0].since + self.batching.interval - time.monotonic()))

    def _due(self) -> tuple[list[_Entry], bytes] | None:
        """The next batch to commit (every file the newest manifest covers, all uploaded), when one is due."""
        state = self.state
        if state.manifest is None or state.manifest[1] == 0:
            return None
        data, count = state.manifest
        batch = state.entries[:count]
        if not all(e.upload is not None and e.upload.done() for e in batch):
            return None
        for e in batch:
            assert e.upload is not None
            if e.upload.exception() is not None:
                return None  # the upload's error is reported through state.error
        old = time.monotonic() - batch[0].since >= self.batching.interval
        if state.draining or state.urgent or len(batch) >= self.batching.every or old:
            return batch, data
        return None

    def _commit(self, entries: list[_Entry], manifest: bytes) -> None:
        ops: list[CommitOperationAdd | CommitOperationDelete] = [e.op for e in entries]
        ops.append(CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=manifest))
        killpoints.reach("hub_before_commit")
        commit = self._send(ops, f"resumerge: commit {len(entries)} file(s)",
                            expect={e.name: e for e in entries}, manifest=manifest)
        killpoints.reach("hub_after_commit")
        for e in entries:  # before the room is announced: a waiting writer may start the next file at once
            discard(e.path)
        with self.cond:
            del self.state.entries[:len(entries)]
            data, count = self.state.manifest or (manifest, len(entries))
            self.state.manifest = (data, count - len(entries))
            self.state.committed_manifest = manifest
            self.state.urgent = False
            self.state.settled.extend(Settled(e.name, commit) for e in entries)
            self.cond.notify_all()

    def _commit_now(self, deletes: list[CommitOperationDelete]) -> None:
        """A commit of the newest manifest alone (plus ``deletes``), in the caller's thread."""
        with self.cond:
            manifest = self.state.manifest[0] if self.state.manifest else None
        ops: list[CommitOperationAdd | CommitOperationDelete] = list(deletes)
        if manifest is not None and manifest != self.state.committed_manifest:
            ops.append(CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=manifest))
        if not ops:
            return
        self._send(ops, "resumerge: update the manifest" if not deletes else f"resumerge: delete {len(deletes)} "
                   "planned file(s)", expect={}, manifest=manifest, deleted={d.path_in_repo for d in deletes})
        with self.cond:
            if manifest is not None:
                self.state.committed_manifest = manifest

    def _send(self, ops: list[CommitOperationAdd | CommitOperationDelete], message: str, *,
              expect: dict[str, _Entry], manifest: bytes | None, deleted: set[str] | None = None) -> str:
        """Create one commit, retried; a retry first checks whether the lost answer's commit happened after all."""
        api = self.repo.api()
        target = self.repo.target
        attempts = 0

        def once() -> str:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and self._landed(expect, manifest, deleted or set()):
                return str(api.repo_info(target.repo_id, revision=target.branch).sha)
            info = api.create_commit(target.repo_id, operations=ops, commit_message=message,
                                     revision=target.branch)
            return str(info.oid)

        with self.commit_lock:
            self._pace()
            commit = with_retries(self.repo, "committing", once, resume=self.resume)
            self.commits += 1
            self.recent.append(time.monotonic())
        return commit

    def _pace(self) -> None:
        """Wait until one more commit stays within ``batching.hourly`` commits in any hour (the hub's limit)."""
        while True:
            now = time.monotonic()
            while self.recent and self.recent[0] <= now - WINDOW:
                self.recent.popleft()
            if len(self.recent) < self.batching.hourly:
                return
            with self.cond:
                if self.state.closed:
                    return
                self.cond.wait(timeout=min(5.0, self.recent[0] + WINDOW - now))

    def _landed(self, expect: dict[str, _Entry], manifest: bytes | None, deleted: set[str]) -> bool:
        """Whether the branch head already holds this commit's content (its answer was lost, not the commit)."""
        files = remote_files(self.repo, resume=self.resume)
        for name, entry in expect.items():
            remote = files.get(name)
            if remote is None or remote.size != entry.size:
                return False
            if remote.sha256 is None and remote.blob_id != git_blob_sha1(entry.path.read_bytes()):
                return False
            if remote.sha256 is not None and remote.sha256 != entry.sha256:
                return False
        if manifest is not None:
            remote = files.get(MANIFEST_NAME)
            if remote is None or remote.blob_id != git_blob_sha1(manifest):
                return False
        return not (deleted & set(files))
