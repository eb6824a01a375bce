"""A hub repo opened as an output: the write-access check, repo creation, its file listing and its manifest.

Everything goes through huggingface_hub's public client with the usual environment (``HF_TOKEN`` or the saved
login, ``HF_ENDPOINT``). The token is held only in :class:`HubRepo` (never printed: ``repr=False``) and never
appears in a message, the ledger or the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile

from resumerge.config.hubtarget import HubTarget
from resumerge.errors import NoSuchOutputError, OutputDirError, StorageError, UnreachableError, UsageError
from resumerge.inputs.hub._hf import TRANSPORT_ERRORS, build_hf_headers, get_bytes
from resumerge.inputs.hub.cache import hub_settings
from resumerge.merge.store.manifest import MANIFEST_NAME, Manifest, parse_manifest

# What a freshly created hub repo holds before anyone writes to it.
INITIAL_FILES = frozenset({".gitattributes"})
# How the hub words its refusals (shared/reference/hub-real.md §1, §3; observed, not documented).
_COMMIT_QUOTA = re.compile(r"rate limit for repository commits \((\d+) per hour\)", re.IGNORECASE)
_RETRY_IN = re.compile(r"retry this action in about (\d+) (hour|minute|second)", re.IGNORECASE)
_STORAGE_QUOTA = ("storage limit", "storage patterns")
_MISSING_OBJECT = "pointer pointed to a file that does not exist"
_XET_REFUSED = ("(401 Unauthorized)", "(403 Forbidden)")
_SHOWN = 300  # characters of a server message shown in an error line
T = TypeVar("T")


# Held for the whole of an xet_disabled scope. The switch is one process-wide value: two scopes open at once in
# threads would each save what the other set, and the later to close would put the other's value back for good.
_XET_SWITCH = threading.Lock()


@contextlib.contextmanager
def xet_disabled(disabled: bool) -> Iterator[None]:
    """huggingface_hub's ``HF_HUB_DISABLE_XET`` set to ``disabled`` for the uploads made inside (the client reads it
    at each upload), and put back after: the switch is process-wide, and the process goes on uploading (a kept
    cluster worker serves the next run; the local sink's other uploads). One scope at a time in a process: a
    thread entering while another's is open waits for it to close (uploads outside any scope are not held up, and
    meanwhile see the switch as the open scope set it)."""
    with _XET_SWITCH:
        saved, constants.HF_HUB_DISABLE_XET = constants.HF_HUB_DISABLE_XET, disabled
        try:
            yield
        finally:
            constants.HF_HUB_DISABLE_XET = saved


@dataclass(frozen=True)
class HubRepo:
    """A hub repo resumerge may write: the target, the endpoint, and the token (never shown)."""

    target: HubTarget
    endpoint: str
    token: str = field(repr=False)

    def api(self) -> HfApi:
        return HfApi(endpoint=self.endpoint, token=self.token, library_name="resumerge")

    @property
    def web_url(self) -> str:
        return f"{self.endpoint}/{self.target.repo_id}"


@dataclass(frozen=True)
class RemoteEntry:
    """One top-level file of the repo at the branch head: size, and the hub's own checksum."""

    size: int
    sha256: str | None  # LFS files: the content's sha256 from the tree listing
    blob_id: str  # git blob sha1 (of the LFS pointer for LFS files)


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the tree listing gives for a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a huggingface_hub error, else None."""
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) if isinstance(exc, HfHubHTTPError) else None


def server_message(exc: BaseException) -> str | None:
    """What the hub said about a refused request (``HfHubHTTPError.server_message``), on one line, else None."""
    if not isinstance(exc, HfHubHTTPError) or not exc.server_message:
        return None
    text = " ".join(exc.server_message.split())
    return text if len(text) <= _SHOWN else text[:_SHOWN - 1] + "…"


def commit_quota(exc: BaseException) -> int | None:
    """The hub's commits per hour when ``exc`` is its commit-quota refusal (429 "You have exceeded the rate limit
    for repository commits (128 per hour)…"), else None. Its ``RateLimit`` headers describe another bucket."""
    if http_status(exc) != 429:
        return None
    found = _COMMIT_QUOTA.search(server_message(exc) or "")
    return int(found[1]) if found else None


def quota_wait(exc: BaseException) -> float:
    """Seconds until the commit quota's window lets a commit through, from the refusal's "retry this action in about
    N hour(s)/minute(s)" (an hour when it does not say)."""
    found = _RETRY_IN.search(server_message(exc) or "")
    if found is None:
        return 3600.0
    return float(int(found[1]) * {"hour": 3600, "minute": 60, "second": 1}[found[2].lower()])


def storage_quota(exc: BaseException) -> bool:
    """True for the hub's storage-quota refusal (403 "Private repository storage limit reached…", or "Your storage
    patterns tripped our internal systems!"): the token is fine, the account is full."""
    message = (server_message(exc) or "").lower()
    return http_status(exc) == 403 and any(s in message for s in _STORAGE_QUOTA)


def missing_object(exc: BaseException) -> bool:
    """True for the commit refusal "an LFS pointer pointed to a file that does not exist" (400): the hub does not
    hold an object the commit names, as after a repo was deleted and recreated and Xet deduplicated the upload
    against the old repo's chunks (huggingface_hub #3829)."""
    return http_status(exc) == 400 and _MISSING_OBJECT in (server_message(exc) or "").lower()


def is_retryable(exc: BaseException) -> bool:
    """True for rate limits, server faults and network errors (worth another try after a pause)."""
    if auth_failed(exc):
        return False
    status = http_status(exc)
    if status is not None:
        return status in (408, 429) or status >= 500
    if isinstance(exc, (*TRANSPORT_ERRORS, ConnectionError, TimeoutError)):
        return True
    # huggingface_hub wraps a failed LFS upload in RuntimeError("Error while uploading ...") from the real cause.
    cause = exc.__cause__
    return isinstance(exc, RuntimeError) and cause is not None and is_retryable(cause)


def auth_failed(exc: BaseException) -> bool:
    """True when the hub refused the token (401/403 other than a storage quota), directly, under huggingface_hub's
    wrapper, or from hf_xet: its ``XetAuthenticationError``, or (hf_xet 1.8 asking for its Xet token) a
    ``ConnectionError`` that quotes the 401/403 answer."""
    if http_status(exc) in (401, 403):
        return not storage_quota(exc)
    if type(exc).__name__ == "XetAuthenticationError":  # hf_xet's (a PermissionError); hf_xet may be absent
        return True
    if isinstance(exc, ConnectionError) and any(s in str(exc) for s in _XET_REFUSED):
        return True
    cause = exc.__cause__
    return isinstance(exc, RuntimeError) and cause is not None and auth_failed(cause)


def hub_call(repo: HubRepo, what: str, call: Callable[[], T], *, resume: str) -> T:
    """Run one request that is not retried here; turn a refused token or an unreachable hub into exit-3 errors."""
    try:
        return call()
    except Exception as exc:
        raise hub_failure(repo, what, exc, resume=resume) from exc


def hub_failure(repo: HubRepo, what: str, exc: BaseException, *, resume: str) -> Exception:
    """The resumerge error for a hub request that failed for good (never quoting the token), with what the hub said."""
    url = repo.target.url
    if isinstance(exc, RepositoryNotFoundError) and http_status(exc) == 404:  # never "try again later"
        return UsageError(f"{url} does not exist on the hub ({_reason(exc)})", path=url,
                          hint=f"start it with: resumerge run CONFIG {url} (a resume continues a repo that exists)")
    if storage_quota(exc):
        return UsageError(f"the hub refused {what} on {url}: the account's storage quota is full ({_reason(exc)})",
                          path=url, hint="a free account holds 100 GB of private storage in all: make the repo "
                          "public on the hub (or start over with --public) or free private storage on the account, "
                          f"then run {resume}")
    if auth_failed(exc):
        return StorageError(f"the hub refused the token while {what} on {url} ({_reason(exc, 401)})",
                            path=url, hint=f"set HF_TOKEN to a valid token with write access, then run {resume}")
    if is_retryable(exc):
        return UnreachableError(f"the hub kept failing while {what} on {url} ({_reason(exc)})", path=url,
                                hint=f"everything committed stays committed; run {resume} when the hub answers")
    return StorageError(f"the hub refused {what} on {url}: {_reason(exc)}", path=url, hint=f"then run {resume}")


def _reason(exc: BaseException, status: int | None = None) -> str:
    """``HTTP 403: <what the hub said>``, or the exception's type and text when no HTTP answer came."""
    status = http_status(exc) or status
    said = server_message(exc)
    if status and said:
        return f"HTTP {status}: {said}"
    if status:
        return f"HTTP {status}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:_SHOWN]}"


def open_hub_repo(target: HubTarget, *, public: bool = False, create: bool = True) -> HubRepo:
    """Check that the token may write ``target`` and make sure the repo (and branch) exist.

    Raises :class:`UsageError` (exit 2) without a token, with an invalid or read-only token, or for a namespace
    the token's user does not belong to; :class:`UnreachableError` (exit 3) when the hub does not answer.
    A missing repo is created private unless ``public``; a missing branch is created from ``main``.
    """
    settings = hub_settings(offline=False)
    token = get_token()
    url = target.url
    if not token:
        raise UsageError(f"writing to {url} needs a Hugging Face token with write access, and none is set",
                         path=url, hint="set HF_TOKEN (or run `hf auth login`) with a write token, then run again")
    repo = HubRepo(target, settings.endpoint, token)
    api = repo.api()
    try:
        info = api.whoami()
    except Exception as exc:
        if auth_failed(exc):
            raise UsageError(f"the hub does not accept the token set for {url} ({_reason(exc, 401)})", path=url,
                             hint="set HF_TOKEN to a valid write token (https://huggingface.co/settings/tokens)"
                             ) from None
        raise hub_failure(repo, "checking the token", exc, resume="the same command") from None
    _check_write_access(info, target)
    if create:
        create_repo(repo, public=public, resume="the same command")
    return repo


def create_repo(repo: HubRepo, *, public: bool, resume: str) -> None:
    """Create the repo (private unless ``public``) and its branch when missing; an existing one is left as it is."""
    api, target = repo.api(), repo.target
    hub_call(repo, "creating the repo", lambda: api.create_repo(target.repo_id, private=not public, exist_ok=True),
             resume=resume)
    if target.branch != "main":
        hub_call(repo, "creating the branch", lambda: api.create_branch(target.repo_id, branch=target.branch,
                                                                        exist_ok=True), resume=resume)


def _check_write_access(info: Mapping[str, Any], target: HubTarget) -> None:
    """Refuse (exit 2) a read-only token or a namespace the token cannot write to."""
    user = str(info.get("name", ""))
    orgs = {str(o.get("name")): str(o.get("roleInOrg", "write")) for o in info.get("orgs", []) or []}
    token_info = (info.get("auth") or {}).get("accessToken") or {}
    role = str(token_info.get("role", "write"))
    url = target.url
    if role == "read":
        raise UsageError(f"the token set for {url} is read-only", path=url,
                         hint="create a token with write access and set HF_TOKEN to it")
    if role == "fineGrained":
        scoped = (token_info.get("fineGrained") or {}).get("scoped") or []
        if not any(str((s.get("entity") or {}).get("name")) == target.namespace
                   and "repo.write" in (s.get("permissions") or []) for s in scoped):
            raise UsageError(f"the fine-grained token set for {url} cannot write repos of {target.namespace}",
                             path=url, hint=f"give the token repo.write on {target.namespace}, or use a write token")
    if target.namespace != user and target.namespace not in orgs:
        raise UsageError(f"the token belongs to {user or 'a user'}, who cannot create or write repos under "
                         f"{target.namespace}", path=url,
                         hint=f"write to hf://{user}/{target.name} or to an organisation you belong to")
    if orgs.get(target.namespace) == "read":
        raise UsageError(f"{user} may only read repos of {target.namespace}", path=url,
                         hint=f"ask an admin of {target.namespace} for write access, or write under hf://{user}/…")


def branch_head(repo: HubRepo, *, resume: str) -> str:
    """The commit the branch points at now (one small request): the ``parent_commit`` of our next commit."""
    api = repo.api()
    info = hub_call(repo, "reading the branch head", lambda: api.repo_info(repo.target.repo_id,
                                                                           revision=repo.target.branch),
                    resume=resume)
    return str(info.sha)


def existing_head(repo: HubRepo, *, resume: str) -> str | None:
    """The branch head, or None when the repo or the branch does not exist (a run killed before it created them:
    never a reason to try again later)."""
    api = repo.api()
    try:
        info = api.repo_info(repo.target.repo_id, revision=repo.target.branch)
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        if http_status(exc) == 404:
            return None
        raise hub_failure(repo, "reading the branch head", exc, resume=resume) from exc
    except Exception as exc:
        raise hub_failure(repo, "reading the branch head", exc, resume=resume) from exc
    return str(info.sha)


def remote_files(repo: HubRepo, *, resume: str, revision: str | None = None) -> dict[str, RemoteEntry]:
    """The top-level files of the branch head (or of commit ``revision``) with their hub checksums (one listing
    request, no download)."""
    api = repo.api()
    entries = hub_call(repo, "listing the repo", lambda: list(api.list_repo_tree(
        repo.target.repo_id, revision=revision or repo.target.branch, recursive=False)), resume=resume)
    return {e.path: RemoteEntry(e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
            for e in entries if isinstance(e, RepoFile) and "/" not in e.path}


def read_file(repo: HubRepo, name: str, *, resume: str, repo_needed: bool = False) -> bytes | None:
    """The bytes of the top-level file ``name`` at the branch head, or None when the repo has no such file.
    ``repo_needed``: a repo the hub says does not exist is :class:`NoSuchOutputError` (exit 2, a mistyped OUT, as
    a local OUT that names no folder), not None (``run`` creates it)."""
    url = f"{repo.endpoint}/{repo.target.repo_id}/resolve/{quote(repo.target.branch, safe='')}/{quote(name)}"

    # No token (a reader of a public repo): no Authorization header, which an empty "Bearer " would break.
    headers = build_hf_headers(token=repo.token or False, library_name="resumerge")
    try:
        response = get_bytes(url, headers=headers)
    except TRANSPORT_ERRORS as exc:
        raise UnreachableError(f"the hub at {repo.endpoint} cannot be reached ({type(exc).__name__})",
                               path=repo.target.url, hint=f"run {resume} when the hub answers") from None
    status = response.status_code
    if status == 404:
        if repo_needed and response.headers.get("X-Error-Code") == "RepoNotFound":
            raise NoSuchOutputError("no such repo on the hub", path=repo.target.url,
                                    hint="check the output repo's name (hf://NAMESPACE/NAME)")
        return None
    if 200 <= status < 300:
        return response.content
    said = " ".join(response.headers.get("X-Error-Message", "").split())[:_SHOWN]
    answer = f"HTTP {status}: {said}" if said else f"HTTP {status}"
    if status in (401, 403):
        raise StorageError(f"the hub refused the token while reading {name} from {repo.target.url} ({answer})",
                           path=repo.target.url, hint=f"set HF_TOKEN to a valid write token, then run {resume}")
    raise UnreachableError(f"reading {name} from {repo.target.url} failed ({answer})",
                           path=repo.target.url, hint=f"run {resume} when the hub answers")


def read_remote_manifest(repo: HubRepo, *, resume: str) -> Manifest | None:
    """The repo's ``resumerge-manifest.json`` at the branch head, or None (one small request)."""
    data = read_file(repo, MANIFEST_NAME, resume=resume)
    return None if data is None else parse_manifest(data, f"{repo.target.url}/{MANIFEST_NAME}")


def check_repo_is_ours(repo: HubRepo, manifest: Manifest | None, *, resume: str,
                       ours: frozenset[str] = frozenset()) -> None:
    """Refuse (exit 4) a repo that holds files besides the hub's initial ones (and ``ours``, files resumerge wrote
    before any manifest, such as a recipe's record) and no resumerge manifest."""
    if manifest is not None:
        return
    foreign = sorted(set(remote_files(repo, resume=resume)) - INITIAL_FILES - ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
        raise OutputDirError(f"{repo.target.url} holds files resumerge did not write ({shown}) and no {MANIFEST_NAME}",
                             path=repo.target.url,
                             hint="write to a new repo or branch (hf://NAMESPACE/NAME@BRANCH); resumerge never "
                                  "overwrites files it did not write")


def check_remote(repo: HubRepo, files: Iterable[tuple[str, int, str]], *, resume: str) -> dict[str, str | None]:
    """For each committed ``(name, size, sha256)``: why the repo's copy cannot be trusted, or None when intact.

    LFS files are checked against the sha256 of the tree listing (no download); small regular files, for which the
    hub gives only a git blob id, are read back and hashed.
    """
    wanted = list(files)
    if not wanted:
        return {}
    remote = remote_files(repo, resume=resume)
    problems: dict[str, str | None] = {}
    for name, size, sha in wanted:
        entry = remote.get(name)
        if entry is None:
            problems[name] = "is missing from the repo"
        elif entry.size != size:
            problems[name] = f"has {entry.size} bytes in the repo, {size} committed"
        elif entry.sha256 is not None:
            problems[name] = None if entry.sha256 == sha else "differs from the committed checksum in the repo"
        else:
            data = read_file(repo, name, resume=resume)
            same = data is not None and hashlib.sha256(data).hexdigest() == sha
            problems[name] = None if same else "differs from the committed checksum in the repo"
    return problems
