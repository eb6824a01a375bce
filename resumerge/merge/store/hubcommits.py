"""Uploads and batched commits to a hub repo, in the background, with retries.

Each published file is uploaded at once on a small thread pool (``preupload_lfs_files``), while the engine computes
the next files. What "never sent twice" means depends on huggingface_hub's path:

- Xet (hf-xet installed, the default of current installs): every upload is a Xet session that chunks the whole file
  again and sends only the chunks the CAS does not know; nothing is skipped per file. A resume re-reads the files
  the killed run had not committed and registers them again, but their chunks are deduplicated (measured against
  the stand-in's ``local://`` CAS with its client caches deleted, as on a fresh machine: across SIGKILL trials the
  CAS received each object's chunk bytes once; a re-ingested object costs a shard of about 540 bytes).
- Git LFS (``HF_HUB_DISABLE_XET=1``): the batch API says which objects the hub already has, and those are not sent
  again; an object cut short is sent whole again.

A committer thread turns uploaded files into commits (``create_commit``) by count (``every`` files) and by time
(``interval`` seconds since the oldest waiting file), always together with the manifest that lists exactly the
committed files plus that batch — so the repo's manifest never names a file the repo lacks. A batch is the leading
files already uploaded: it never waits for a file still uploading, so commits land while the next uploads run.
A commit counts only when the hub answered it; the staged copies are deleted after that, and each file's
:class:`~resumerge.merge.store.sink.Receipt` is settled with the commit id (the caller then writes the ledger rows). A
commit or upload that fails for good fails every waiting receipt with its error.

429, 5xx and network errors are retried with exponential backoff (``Retry-After`` honoured); a commit whose
answer was lost is recognised from the tree listing instead of being sent twice. Commits are paced to at most
``Batching.hourly`` in any hour, under the hub's 128 commits per repo and hour; when the hub refuses a commit for
its commit quota anyway, the user is told until when and the commit waits for the window. A commit the hub refuses
because it does not hold what Xet uploaded (a repo deleted and recreated) has its files uploaded once more through
the LFS batch API. Every refusal shows the hub's own message.

Two writers: every commit names the branch head this process last saw as its ``parent_commit`` (read when OUT was
opened, then the oid each of our commits returns), so the hub refuses (HTTP 412) a commit on a branch another run
moved, and the run stops with exit 4 instead of interleaving commits with it.

A stopped run (:meth:`CommitQueue.stop`) makes one last commit of the files already uploaded, in the background, so
the caller can bound its wait on their receipts and abandon it; uploads run on daemon threads for the same reason: a
stopped process never waits for a transfer in flight.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from resumerge.config.settings import Batching
from resumerge.errors import OutputDirError, ResumergeError
from resumerge.machine import killpoints
from resumerge.machine.durable import discard
from resumerge.merge.store.hubrepo import (
    HubRepo,
    branch_head,
    git_blob_sha1,
    http_status,
    missing_object,
    remote_files,
    xet_disabled,
)
from resumerge.merge.store.hubretry import pace_wait, to_stderr, with_retries
from resumerge.merge.store.manifest import MANIFEST_NAME
from resumerge.merge.store.sink import Receipt
from resumerge.merge.store.uploads import DaemonUploads


@dataclass
class _Entry:
    name: str
    path: Path | None  # None: uploaded by a cluster node, nothing staged here
    sha256: str
    size: int
    op: CommitOperationAdd
    since: float
    receipt: Receipt
    upload: Future[None] | None = None
    ready: Callable[[], bool] | None = None  # the file may be committed only once this is true (inputs checked)
    without_xet: bool = False  # uploaded again through the LFS batch API after the hub lost its Xet upload


@dataclass
class _State:
    entries: list[_Entry] = field(default_factory=list)  # published, not committed, in publish order
    manifest: tuple[bytes, int] | None = None  # newest manifest and how many entries it covers
    # Every manifest since the last commit, by how many files were ever published when it was set: a stopped run
    # commits only the uploaded files, with the manifest that lists exactly those.
    history: dict[int, bytes] = field(default_factory=dict)
    done: int = 0  # files committed so far (history's keys count from the start of the run, like this)
    committed_manifest: bytes | None = None
    error: BaseException | None = None
    urgent: bool = False  # staged bytes are over --max-disk: commit what is ready without waiting for a full batch
    draining: bool = False  # the run's last files: commit them together once all are uploaded
    stopping: bool = False  # the run was stopped: no new batch, only the last commit of stop()
    closed: bool = False


class _DropEmptyCommitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No files have been modified since last commit")


@contextlib.contextmanager
def _no_empty_commit_warning() -> Iterator[None]:
    """Silence huggingface_hub's warning for a commit it skips because nothing changed: a resumed run's first
    manifest commit repeats the killed run's last one, and the skipped commit is what we want (its answer is the
    branch head, as for any commit)."""
    logger, quiet = logging.getLogger("huggingface_hub.hf_api"), _DropEmptyCommitWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class CommitQueue:
    """The background uploads and commits of one run into one repo.

    ``head`` is the branch head when OUT was opened (read now when None); ``should_stop`` ends :meth:`flush`'s
    wait early (the run was interrupted: :meth:`stop` then commits what is uploaded)."""

    def __init__(self, repo: HubRepo, batching: Batching, *, resume: str, uploads: int = 2, head: str | None = None,
                 should_stop: Callable[[], bool] = lambda: False, tell: Callable[[str], None] | None = None) -> None:
        self.repo, self.batching, self.resume = repo, batching, resume
        self.tell = tell or to_stderr  # what the user must hear while the run goes on (a quota's wait)
        self.should_stop = should_stop
        self.head = head if head is not None else branch_head(repo, resume=resume)
        self.state = _State()
        self.cond = threading.Condition()
        self.commit_lock = threading.RLock()  # reentrant: the last commit of stop() holds it around _commit
        self.pool = DaemonUploads(uploads)
        self.commits = 0
        self.uploaded_bytes = self.committed_bytes = 0  # of the staged files (progress shows both)
        self.recent: deque[float] = deque()  # when this process's commits of the last hour were made
        self.thread = threading.Thread(target=self._loop, name="resumerge-committer", daemon=True)
        self.thread.start()

    # ---- the engine's side -------------------------------------------------------------------------------
    def add(self, name: str, path: Path, sha256: str, size: int, *, ready: Callable[[], bool] | None = None) -> Receipt:
        """Take over the staged file ``path`` (``name`` in the repo) and start uploading it; the receipt is settled
        by the commit that holds it, which waits until ``ready()`` (when given) is true."""
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
        op.upload_info.sha256 = bytes.fromhex(sha256)  # known already: the client need not hash it again
        entry = _Entry(name, path, sha256, size, op, time.monotonic(), Receipt(name), ready=ready)
        with self.cond:
            self._raise_error()
            self.state.entries.append(entry)
        entry.upload = self.pool.submit(lambda: self._upload(entry))
        entry.upload.add_done_callback(lambda _: self._notify())
        return entry.receipt

    def add_uploaded(self, name: str, op: CommitOperationAdd, sha256: str, size: int, *,
                     ready: Callable[[], bool] | None = None) -> Receipt:
        """Take over ``name``, which another machine uploaded already (``op`` names the hub's object): it joins
        the next batch like an uploaded staged file; the receipt is settled by the commit that holds it."""
        uploaded: Future[None] = Future()
        uploaded.set_result(None)
        entry = _Entry(name, None, sha256, size, op, time.monotonic(), Receipt(name), uploaded, ready=ready)
        with self.cond:
            self._raise_error()
            self.state.entries.append(entry)
            self.cond.notify_all()
        return entry.receipt

    def set_manifest(self, data: bytes) -> None:
        """The newest manifest: committed with the next batch, or at once when no file is waiting."""
        with self.cond:
            self._raise_error()
            self.state.manifest = (data, len(self.state.entries))
            self.state.history[self.state.done + len(self.state.entries)] = data
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

    def flush(self) -> None:
        """Commit every waiting file and the newest manifest, and wait for it; returns early when the run is
        stopping (then :meth:`stop` commits what is uploaded by then)."""
        with self.cond:
            covered = self.state.manifest[1] if self.state.manifest else 0
            if covered < len(self.state.entries):
                raise ResumergeError("internal: files were published without a manifest that lists them")
            while self.state.entries:
                self._raise_error()
                if self.should_stop():
                    return
                self.state.draining = True
                self.cond.notify_all()
                self.cond.wait(timeout=0.5)
            pending = self.state.manifest is not None and self.state.manifest[0] != self.state.committed_manifest
        if pending:
            self._commit_now([])
        with self.cond:
            self._raise_error()

    def delete(self, names: list[str]) -> None:
        """Delete ``names`` from the repo in one commit, with the newest manifest. Only before files are published
        (reconcile and ``--restart`` clean up before the engine writes)."""
        with self.cond:
            if self.state.entries:
                raise ResumergeError("internal: a delete while files wait for their commit")
        self._commit_now([CommitOperationDelete(path_in_repo=n) for n in names])

    def stop(self) -> list[Receipt]:
        """The run is stopping: commit no new batch, and start one last commit, in the background, of the files
        already uploaded (with the manifest that lists exactly them). Returns their receipts (none: nothing to
        commit), which that commit settles, or fails with its error; never raises the hub's error."""
        with self.cond:
            self.state.stopping = True
            self.cond.notify_all()
            count = 0 if self.state.error is not None else self._uploaded()
            receipts = [e.receipt for e in self.state.entries[:count]]
        if receipts:
            threading.Thread(target=self._final, name="resumerge-final-commit", daemon=True).start()
        return receipts

    def close(self) -> None:
        with self.cond:
            self.state.closed = True
            stopping = self.state.stopping
            self.cond.notify_all()
        # A stopped run leaves at once: uploads and the last commit in flight are abandoned (daemon threads).
        self.pool.shutdown(wait=not stopping)
        self.thread.join(timeout=0 if stopping else 30)

    # ---- background ------------------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _raise_error(self) -> None:
        if self.state.error is not None:
            raise self.state.error

    def _fail(self, exc: BaseException) -> None:
        """Record the queue's first error and fail every waiting receipt with it (under ``cond``)."""
        self.state.error = self.state.error or exc
        for entry in self.state.entries:
            entry.receipt.fail(self.state.error)
        self.cond.notify_all()

    def _upload(self, entry: _Entry) -> None:
        api = self.repo.api()
        try:
            with_retries(self.repo, f"uploading {entry.name}", lambda: api.preupload_lfs_files(
                self.repo.target.repo_id, additions=[entry.op], revision=self.repo.target.branch,
                free_memory=False), resume=self.resume)
        except BaseException as exc:
            with self.cond:
                self._fail(exc)
            raise
        with self.cond:
            self.uploaded_bytes += entry.size
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
                    self._fail(exc)
                return

    def _timeout(self) -> float:
        entries = self.state.entries
        if not entries:
            return 1.0
        first = entries[0]
        if first.ready is not None and first.upload is not None and first.upload.done() and not self._ready(first):
            # Uploaded, its inputs' proof about to end (it ends as the first shard's units have read their ranges):
            # asked again soon, where a second's wait let a short run's every later file join the first commit.
            return 0.05
        return max(0.05, min(1.0, first.since + self.batching.interval - time.monotonic()))

    def _due(self) -> tuple[list[_Entry], bytes] | None:
        """The next batch to commit, when one is due: the leading files already uploaded, with the manifest that
        listed exactly them (and what is committed). Files still uploading wait for a later commit: a batch
        never waits for the newest file's upload, so commits land while uploads go on."""
        state = self.state
        if state.manifest is None or state.manifest[1] == 0 or state.stopping:
            return None
        count = min(self._uploaded(), state.manifest[1])
        if count == 0:
            return None
        batch, data = state.entries[:count], state.history[state.done + count]
        # Over --max-disk, what is ready goes at once; at the run's end, the last files go in one commit as soon as
        # every one is uploaded. Until then a draining run is paced like any other: when the merge outruns the upload
        # (local inputs, a slow uplink) most of the run is its end, and committing each file as its upload finished
        # spent a commit per file (43 for the 59 files of a 1.75 GB output at 75 MB/s) against the hub's hourly quota.
        if state.urgent or (state.draining and count == len(state.entries)):
            return batch, data
        now = time.monotonic()
        if pace_wait(self.recent, now, len(self.recent) + 1, burst=self.batching.burst,
                     spacing=self.batching.spacing) > 0:
            return None  # spaced out: the files uploaded meanwhile join this batch (the run's end never waits)
        if len(batch) >= self.batching.every or now - batch[0].since >= self.batching.interval:
            return batch, data
        return None

    def _uploaded(self) -> int:
        """How many leading files are uploaded and have a manifest listing exactly them plus what is committed."""
        count = 0
        for e in self.state.entries:
            if e.upload is None or not e.upload.done() or e.upload.cancelled() or e.upload.exception() is not None:
                break
            if not self._ready(e):
                break
            count += 1
        while count and self.state.done + count not in self.state.history:
            count -= 1
        return count

    def _ready(self, entry: _Entry) -> bool:
        """Whether ``entry`` may be committed (under ``cond``): a failed check fails the queue."""
        if entry.ready is None:
            return True
        try:
            ready = entry.ready()
        except Exception as exc:
            self._fail(exc)
            return False
        if ready:
            entry.ready = None  # checked once for good
        return ready

    def _final(self) -> None:
        """The last commit of a stopped run: what is uploaded once a batch commit in flight has finished."""
        try:
            with self.commit_lock:
                with self.cond:
                    count = self._uploaded()
                    batch = self.state.entries[:count]
                    manifest = self.state.history.get(self.state.done + count)
                if batch and manifest is not None:
                    self._commit(batch, manifest)
        except BaseException as exc:
            with self.cond:  # the receipts this commit was to settle; the others wait for no commit anyway
                for entry in self.state.entries:
                    entry.receipt.fail(exc)

    def _commit(self, entries: list[_Entry], manifest: bytes) -> None:
        ops: list[CommitOperationAdd | CommitOperationDelete] = [e.op for e in entries]
        ops.append(CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=manifest))
        killpoints.reach("hub_before_commit")
        commit = self._send(ops, f"resumerge: commit {len(entries)} file(s)",
                            expect={e.name: e for e in entries}, manifest=manifest)
        killpoints.reach("hub_after_commit")
        for e in entries:  # before the room is announced: a waiting writer may start the next file at once
            if e.path is not None:
                discard(e.path)
        with self.cond:
            del self.state.entries[:len(entries)]
            data, count = self.state.manifest or (manifest, len(entries))
            self.state.manifest = (data, count - len(entries))
            self.state.done += len(entries)
            self.committed_bytes += sum(e.size for e in entries)
            self.state.history = {k: v for k, v in self.state.history.items() if k > self.state.done}
            self.state.committed_manifest = manifest
            self.state.urgent = False
            for e in entries:
                e.receipt.settle(commit)
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

        def create() -> str:
            try:
                with _no_empty_commit_warning():
                    info = api.create_commit(target.repo_id, operations=ops, commit_message=message,
                                             revision=target.branch, parent_commit=self.head)
            except Exception as exc:
                if http_status(exc) == 412:  # the hub's answer when the branch head is not our parent_commit
                    raise self._other_writer() from exc
                raise
            return str(info.oid)

        def once() -> str:
            nonlocal attempts
            attempts += 1
            landed = self._landed(expect, manifest, deleted or set()) if attempts > 1 else None
            if landed is not None:
                return landed
            try:
                return create()
            except Exception as exc:
                if not missing_object(exc) or not expect or any(
                        e.without_xet or e.path is None for e in expect.values()):  # a node's upload is not here
                    raise
            old = {id(e.op): e for e in expect.values()}
            self._upload_without_xet(list(expect.values()))  # once; then the same commit names what it sent
            ops[:] = [old[id(op)].op if id(op) in old else op for op in ops]
            return create()

        with self.commit_lock:
            self._pace()
            commit = with_retries(self.repo, "committing", once, resume=self.resume, sleep=self._backoff,
                                  tell=self.tell)
            self.head = commit
            self.commits += 1
            self.recent.append(time.monotonic())
        return commit

    def _upload_without_xet(self, entries: list[_Entry]) -> None:
        """Upload ``entries`` once more through the Git-LFS batch API: the hub refused a commit naming objects it
        does not hold although Xet took them, as after a repo was deleted and recreated (Xet deduplicated them
        against the old repo's chunks). huggingface_hub reads ``HF_HUB_DISABLE_XET`` on every upload, so only these
        uploads (and any that start meanwhile, which LFS serves as well) leave Xet aside."""
        self.tell(f"the hub does not hold {len(entries)} file(s) Xet uploaded to {self.repo.target.url} (was the "
                  "repo deleted and recreated?): uploading them once more without Xet")
        api = self.repo.api()
        ops = []
        for e in entries:
            e.op = CommitOperationAdd(path_in_repo=e.name, path_or_fileobj=str(e.path))  # staged: path is set
            e.op.upload_info.sha256 = bytes.fromhex(e.sha256)
            e.without_xet = True
            ops.append(e.op)
        with xet_disabled(True):  # one such scope at a time in this process
            with_retries(self.repo, "uploading without Xet", lambda: api.preupload_lfs_files(
                self.repo.target.repo_id, additions=ops, revision=self.repo.target.branch, free_memory=False),
                resume=self.resume, sleep=self._backoff, tell=self.tell)

    def _backoff(self, seconds: float) -> None:
        """The pause before a commit's next attempt (an hour, for the commit quota); a stopped run that left
        (closed) abandons it instead."""
        end = time.monotonic() + seconds
        with self.cond:
            while not self.state.closed and (left := end - time.monotonic()) > 0:
                self.cond.wait(timeout=left)  # woken by every upload and manifest: wait out the rest
            if self.state.closed and self.state.stopping:
                raise ResumergeError("internal: the last commit of a stopped run was abandoned")

    def _pace(self) -> None:
        """Wait until one more commit stays within ``batching.hourly`` commits in any hour (the hub's limit); the
        user hears of a wait longer than a minute."""
        told = False
        while (wait := pace_wait(self.recent, time.monotonic(), self.batching.hourly)) > 0:
            if not told and wait > 60:
                until = time.strftime("%H:%M", time.localtime(time.time() + wait))
                self.tell(f"{len(self.recent)} commits to {self.repo.target.url} in the last hour: the next one waits "
                          f"until {until} to stay under the hub's commits per hour; Ctrl-C is safe")
                told = True
            with self.cond:
                if self.state.closed:
                    return
                self.cond.wait(timeout=min(5.0, wait))

    def _other_writer(self) -> OutputDirError:
        url = self.repo.target.url
        try:
            head = branch_head(self.repo, resume=self.resume)
        except ResumergeError:
            head = "(unknown: the hub did not say)"
        return OutputDirError(f"another run is writing to {url}: its commit {head} moved the branch",
                              hint=f"stop the other run, then {self.resume}")

    def _landed(self, expect: dict[str, _Entry], manifest: bytes | None, deleted: set[str]) -> str | None:
        """The branch head when it already holds this commit's content (its answer was lost, not the commit).

        The head is read first and listed at that commit, so the answer is about one commit. Its content is our
        manifest (which names this run's config and files) and our files: adopting it as our parent is sound —
        a head that another writer moved past our commit no longer holds exactly that, and then the retry names
        our old parent and the hub refuses it (412: another writer)."""
        head = branch_head(self.repo, resume=self.resume)
        files = remote_files(self.repo, resume=self.resume, revision=head)
        for name, entry in expect.items():
            remote = files.get(name)
            if remote is None or remote.size != entry.size:
                return None
            if remote.sha256 is None and remote.blob_id != git_blob_sha1(_content(entry)):
                return None
            if remote.sha256 is not None and remote.sha256 != entry.sha256:
                return None
        if manifest is not None:
            remote = files.get(MANIFEST_NAME)
            if remote is None or remote.blob_id != git_blob_sha1(manifest):
                return None
        return None if deleted & set(files) else head


def _content(entry: _Entry) -> bytes:
    """The bytes of a file the hub keeps in git (a small one): staged here, or carried by its operation."""
    if entry.path is not None:
        return entry.path.read_bytes()
    data = entry.op.path_or_fileobj
    return data if isinstance(data, bytes) else b""
