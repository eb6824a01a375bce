"""A hub repo as the output sink: files are staged on local disk, uploaded, and committed to the repo in batches.

A planned file is written and fsynced under ``staging`` (in the run's state dir), handed to the
:class:`~resumerge.merge.store.hubcommits.CommitQueue` (uploaded at once, committed with the next batch together with
the manifest that lists it) and deleted from staging only after that commit succeeded. :meth:`HubRepoSink.publish`
therefore answers with a receipt that the commit settles later, and the journal writes the ledger row then. A file
a cluster node staged and uploaded on its own disk joins the same batches (:meth:`HubRepoSink.publish_uploaded`).
Committed files are checked against the hub's own checksums: the sha256 of LFS files from the tree listing (no
download; files uploaded through Xet are listed with it too), small regular files (configs, tokenizer) by reading
them back. How uploads avoid sending anything twice (Xet or Git LFS) is told in
:mod:`~resumerge.merge.store.hubcommits`.

``max_disk`` bounds staged, uncommitted bytes: before a new file is started, the sink waits (committing early)
until what is staged plus the largest planned file fits in it.

``head`` is the branch head read when OUT was opened: every commit names the head it expects, so a second writer
on the same branch is refused (exit 4) instead of interleaving commits. A stopped run commits what is already
uploaded (:meth:`HubRepoSink.stop`) rather than leaving it to the resume to compute again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd

from resumerge.config.settings import Batching
from resumerge.errors import ResumergeError
from resumerge.machine.checksums import SHA256, Checksum, written_with
from resumerge.machine.durable import is_temp_name, temp_path
from resumerge.merge.store.hubcommits import CommitQueue
from resumerge.merge.store.hubrepo import HubRepo, check_remote, remote_files
from resumerge.merge.store.manifest import MANIFEST_NAME
from resumerge.merge.store.sink import OutputSink, Receipt


@dataclass(frozen=True)
class StagingBudget:
    """The local disk staged, uncommitted files may take: ``max_disk`` bytes (``--max-disk``, less what the run's
    hub inputs take), of which ``reserve`` are kept for the files staged at once (the largest, a release's
    together): a new file starts only once what is staged fits in the :attr:`room` left."""

    max_disk: int
    reserve: int = 0

    @property
    def room(self) -> int:
        return max(0, self.max_disk - self.reserve)


class HubRepoSink(OutputSink):
    """OUT is ``hf://NAMESPACE/NAME[@BRANCH]``: stage, upload, commit in batches with the manifest."""

    commits_later = True
    # The hub names an LFS object by its sha256: the writer's digest is the upload's oid and the ledger's record.
    checksum: Checksum = SHA256

    def __init__(self, repo: HubRepo, staging: Path, *, planned: Iterable[str], resume: str,
                 batching: Batching | None = None, budget: StagingBudget | None = None, head: str | None = None,
                 should_stop: Callable[[], bool] = lambda: False, tell: Callable[[str], None] | None = None) -> None:
        """``budget``: what staged files may take on the local disk; None: no bound."""
        self.repo, self.staging, self.resume = repo, staging, resume
        self.budget = budget
        staging.mkdir(parents=True, exist_ok=True)
        names = set(planned) | {MANIFEST_NAME}
        for leftover in staging.iterdir():  # temp files of a run that died: only resumerge's own names
            if is_temp_name(leftover.name, names):
                leftover.unlink()
        # ``tell``: the run's reporter (and ledger), so a commit-quota wait shows in the progress display and status.
        self.queue = CommitQueue(repo, batching or Batching(), resume=resume, head=head, should_stop=should_stop,
                                 tell=tell)
        self._ready: dict[str, Callable[[], bool]] = {}  # files to upload now but commit only once ready

    @property
    def commits(self) -> int:
        """Commits this sink made so far."""
        return self.queue.commits

    def transferred(self) -> tuple[int, int]:
        """Bytes of staged files uploaded so far, and of those a commit holds (the progress display's "up")."""
        with self.queue.cond:
            return self.queue.uploaded_bytes, self.queue.committed_bytes

    def where(self, name: str) -> Path:
        return self.staging / name

    def temp_for(self, name: str) -> Path:
        if self.budget is not None:
            self.queue.wait_room(self.budget.room)
        return self.staging / temp_path(self.staging / name).name

    def commit_when(self, name: str, ready: Callable[[], bool]) -> None:
        self._ready[name] = ready

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        return self.queue.add(name, temp, _oid(sha256), temp.stat().st_size, ready=self._ready.pop(name, None))

    def publish_uploaded(self, name: str, op: CommitOperationAdd, sha256: str, size: int) -> Receipt:
        """Like :meth:`publish`, for a file another machine staged and uploaded itself (a cluster node): ``op``
        names the hub's object; nothing is staged here, so it takes none of the budget."""
        return self.queue.add_uploaded(name, op, _oid(sha256), size, ready=self._ready.pop(name, None))

    def replace_small(self, name: str, data: bytes) -> None:
        if name != MANIFEST_NAME:
            raise ValueError(f"internal: a hub repo keeps only {MANIFEST_NAME} as a small file, not {name}")
        self.queue.set_manifest(data)

    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        return check_remote(self.repo, files, resume=self.resume)

    def names(self) -> list[str]:
        return sorted(remote_files(self.repo, resume=self.resume))

    def delete(self, names: Iterable[str]) -> None:
        wanted = set(names)
        if not wanted:
            return
        present = sorted(wanted & set(remote_files(self.repo, resume=self.resume)))
        if present:
            self.queue.delete(present)

    def flush(self) -> None:
        self.queue.flush()

    def stop(self) -> list[Receipt]:
        return self.queue.stop()

    def close(self) -> None:
        self.queue.close()


def _oid(recorded: str) -> str:
    """``recorded`` as the sha256 the hub's LFS needs (a record of another algorithm reaching a hub is a defect)."""
    found = written_with(recorded)
    if found.name != SHA256.name:
        raise ResumergeError(f"internal: a file for the hub was hashed as {found.name}, not sha256")
    return recorded
