"""A hub OUT on a cluster: the node that made a shard uploads it to the repo's storage; the driver only commits.

For an ``hf://`` OUT the driver gives each task a :class:`HubPlace` (the repo, branch, endpoint and upload tier:
nothing secret). The task writes its shard on its own node's disk, uploads it there (:func:`upload_shard`: the
Git-LFS batch API, or Xet through hf-xet, exactly as the local sink's uploads), deletes the file and returns an
:class:`Uploaded` reference beside the shard's size and sha256 — no bytes go back to the driver. The driver turns
the reference into the commit operation of an uploaded file (:func:`commit_operation`) and commits it with the
hub sink's batches (many files per commit, the hub's commit rate respected); the ledger row is written once that
commit succeeded, as for every hub file.

The token never travels: a worker reads its own (``HF_TOKEN`` in its environment, or the saved login of its
user), so it is in no plan, task argument, log line or ledger row; a node without one fails its task with a
one-line usage error (exit 2). A shard uploaded but not committed when the driver died is sent again by the
resume's task, which costs no bytes: the LFS batch API answers that the object is there (same sha256), and Xet
deduplicates its chunks; an object nobody commits is the hub's garbage. Nothing is committed twice: only the
driver commits, from its ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from huggingface_hub import CommitOperationAdd, constants, get_token
from huggingface_hub.lfs import UploadInfo

from resumerge.config.hubtarget import HubTarget
from resumerge.errors import UsageError
from resumerge.merge.store.hubrepo import HubRepo, xet_disabled
from resumerge.merge.store.hubretry import with_retries


@dataclass(frozen=True)
class HubPlace:
    """Where a task uploads: the repo and branch, the hub's endpoint, whether the driver's client uploads through
    Xet (every node then does, where hf-xet is installed), and the command that resumes the run (for errors)."""

    target: HubTarget
    endpoint: str
    xet: bool
    resume: str

    @classmethod
    def of(cls, repo: HubRepo, resume: str) -> HubPlace:
        """The place of ``repo`` as this (the driver's) process would upload to it; the token stays here."""
        return cls(repo.target, repo.endpoint, uploads_through_xet(), resume)


def uploads_through_xet() -> bool:
    """Whether this process's huggingface_hub client uploads through Xet: the hf-xet distribution installed and
    ``HF_HUB_DISABLE_XET`` unset (read as the client reads it, at each call)."""
    # The client's own test (2.4.0: utils/_runtime.py's is_xet_available, an installed distribution, not an
    # importable module) is private, and the utils package re-exports its is_package_available only implicitly
    # (mypy --strict refuses it): the same test, written here once (a test holds it to the client's).
    if constants.HF_HUB_DISABLE_XET:
        return False
    try:
        metadata.version("hf_xet")
    except metadata.PackageNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Uploaded:
    """What a task's upload hands back: how the hub stores the file (``lfs``, else ``regular`` with its
    ``content``: the hub keeps small files in git, which a commit then carries), and whether a ``.gitignore`` of
    the repo ignores it."""

    mode: str
    ignored: bool = False
    content: bytes | None = None


def upload_shard(place: HubPlace, path: Path, name: str, sha256: str) -> Uploaded:
    """Upload the file at ``path`` as ``name`` to ``place``'s storage (not committed); returns its reference.
    Raises :class:`UsageError` when this node has no token, and the hub's exit-3 error when the upload keeps
    failing (after the retries of :func:`~resumerge.merge.store.hubretry.with_retries`)."""
    token = get_token()
    if not token:
        raise UsageError(f"a cluster node uploading to {place.target.url} has no Hugging Face token",
                         path=place.target.url,
                         hint="set HF_TOKEN (or run `hf auth login`) on every node, then " + place.resume)
    repo = HubRepo(place.target, place.endpoint, token)
    # The driver's tier: a node whose client would choose the other one uploads as the driver does (where hf-xet
    # is missing, the client's test stays false and LFS serves). The switch is process-wide and a kept worker's
    # process serves the next run too, so it is put back after the upload (a node's writer uploads one at a time).
    with xet_disabled(not place.xet):
        op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
        op.upload_info.sha256 = bytes.fromhex(sha256)  # known already: the client need not hash it again
        api = repo.api()
        with_retries(repo, f"uploading {name}", lambda: api.preupload_lfs_files(
            place.target.repo_id, additions=[op], revision=place.target.branch, free_memory=False),
            resume=place.resume)
    uploaded = _uploaded(op)
    return uploaded if uploaded.mode == "lfs" else replace(uploaded, content=path.read_bytes())


def commit_operation(name: str, size: int, sha256: str, uploaded: Uploaded) -> CommitOperationAdd:
    """The commit operation of ``name`` as a task uploaded it: the hub's reference to the object (its sha256 and
    size), with no file behind it on this machine (or the small file's content)."""
    op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=uploaded.content or b"")
    if uploaded.content is None:
        op.upload_info = UploadInfo(size=size, sample=b"", sha256=bytes.fromhex(sha256))
    _mark_uploaded(op, uploaded)
    return op


# huggingface_hub 2.4.0 (checked) has no public way to read what preupload_lfs_files learnt of a file (how the hub
# stores it, whether a .gitignore ignores it), nor to build the operation of a file another process uploaded: both
# live in CommitOperationAdd's private fields, which the hub's own upload pipeline (_upload_pipeline.py) sets the
# same way. These two functions are the only places resumerge touches them.
def _uploaded(op: CommitOperationAdd) -> Uploaded:
    """What ``preupload_lfs_files`` learnt of ``op`` (without a regular file's content)."""
    return Uploaded("lfs" if op._upload_mode == "lfs" else "regular", bool(op._should_ignore))


def _mark_uploaded(op: CommitOperationAdd, uploaded: Uploaded) -> None:
    """Make ``op`` the operation of a file uploaded as ``uploaded`` says, for a commit to carry as it is."""
    op._upload_mode = "lfs" if uploaded.mode == "lfs" else "regular"
    op._should_ignore = uploaded.ignored
    op._is_uploaded = True


def task_cpus(threads: int, node_cpus: Iterable[float], max_disk: int | None, largest: int) -> int:
    """The CPUs each worker of a hub OUT declares: ``threads`` (the run's thread count), raised under ``max_disk``
    so that no node runs more workers than it may stage shards of ``largest`` bytes (each worker holds one shard on
    its node's disk until uploaded); the largest node still takes one. Ray places by CPUs, so this is
    what bounds a node's staged bytes, as the local sink's wait bounds the driver's."""
    most = max((int(c) for c in node_cpus), default=1)
    if max_disk is None or largest <= 0:
        return threads
    per_node = max(1, max_disk // largest)
    return max(threads, min(most, -(-most // per_node)))
