"""The upload side of the stand-in hub: tokens and whoami, repo and branch creation, preupload, Xet tokens, the
LFS batch API and object PUT, the NDJSON commit, with counters and faults.

Attach it to a :class:`~hub.fakehub.FakeHub` with :meth:`HubWriter.attach`; the hub's request handler hands every
route to :meth:`HubWriter.route` first. New commits go through ``FakeHub.push`` so the read routes (tree listing
with LFS sha256 and ``xetHash``, resolve) serve them at once.

Routes (``REPO`` is ``NAMESPACE/NAME``):

- ``GET /api/whoami-v2``; ``POST /api/validate-yaml``; ``POST /api/repos/create``;
  ``POST /api/models/REPO/branch/BRANCH``;
- ``POST /api/models/REPO/preupload/REV`` (at most :data:`PREUPLOAD_MAX_FILES` files a call, as on the Hub);
- ``GET /api/models/REPO/xet-write-token/REV`` and ``xet-read-token/REV``: only with a :class:`~hub.fakehub_xet.XetCas`
  attached (``cas``, the Xet tier), answered with its ``local://`` folder as ``casUrl`` (JSON and ``X-Xet-*``
  headers); without one, 404, and the client must not ask (``HF_HUB_DISABLE_XET=1``: the LFS tier);
- ``POST /REPO.git/info/lfs/objects/batch`` (at most :data:`BATCH_MAX_OBJECTS` objects) and ``PUT /_lfs/REPO/OID``;
- ``POST /api/models/REPO/commit/REV``.

What the Hub enforces and the stand-in does too: a commit whose header names a ``parentCommit`` other than the
branch head is refused with 412 (optimistic concurrency between two writers); an ``lfsFile`` whose object the hub
does not hold (neither PUT to this repo nor registered by a shard of the Xet CAS) is refused with 400 and the Hub's
text; the per-call file limits above; a write token for the namespace on every write route.

Faults, all on this class: ``commit_faults`` (statuses, or :class:`Refusal` with the Hub's own text, for the next
commit requests: the commit-quota 429 and storage-quota 403 are :data:`COMMIT_QUOTA` and :data:`STORAGE_QUOTA`);
``upload_faults`` (statuses for the next LFS PUTs); ``cut_put_after`` (cut the next PUT after N bytes);
``xet_token_faults`` (statuses for the next Xet token requests); ``recreated`` (repos deleted and recreated on the
Hub: their commits refuse objects that only Xet holds, as the Hub does, huggingface_hub #3829, until they arrive
by LFS PUT); a token taken out of ``tokens`` (revoked); and hooks: when a commit arrives (``on_commit``: the
kill trials SIGKILL the merging process from it, before or after the commit is applied; returning False drops the
request unapplied, or the answer of an applied commit), when an upload arrives (``on_upload``; it may block,
stalling the upload), and when any request arrives
(``on_request``: the start-up kill trials SIGKILL the process at its token check or repo creation).
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from hub.fakehub import LFS_SUFFIXES, FakeHub, git_blob_sha1, remember_digest, sha256_of
from hub.fakehub_xet import XetCas

if TYPE_CHECKING:
    from hub.fakehub import _Handler

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
# Called with (n-th commit request, "received" | "applied"); returning False at "received" drops the request unapplied,
# at "applied" drops the answer (the commit happened, the client never hears it).
CommitHook = Callable[[int, str], "bool | None"]
# Called with (method, path parts) of every request before it is routed; returning False drops it unanswered.
RequestHook = Callable[[str, list[str]], "bool | None"]
# Called with the n-th upload the hub sees, and may block to stall it: an LFS PUT (its body read, before it is stored),
# or in the Xet tier a write-token request, which every upload session (one per preupload call) makes first.
UploadHook = Callable[[int], None]
PRECONDITION_FAILED = "The branch was updated since you opened this page. Please refresh and try again."
# The Hub's texts (shared/reference/hub-real.md §1, §3).
COMMIT_QUOTA = ("You have exceeded the rate limit for repository commits (128 per hour). You can retry this action "
                "in about 1 hour. If you're a new user, your limits will raise progressively over time.")
STORAGE_QUOTA = "Private repository storage limit reached, please upgrade your plan to increase your storage quota."
MISSING_OBJECT = "Your push was rejected because an LFS pointer pointed to a file that does not exist"
PREUPLOAD_MAX_FILES = 256
BATCH_MAX_OBJECTS = 256


@dataclass(frozen=True)
class Refusal:
    """A commit fault with the Hub's own message (and, for a 429, the 5-minute bucket's ``RateLimit`` headers, which
    say nothing about the commit quota: a client that trusts them retries far too early)."""

    status: int
    message: str
    ratelimit: bool = False


@dataclass
class HubWriter:
    """Write routes, state and faults of one stand-in hub."""

    hub: FakeHub
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)  # token -> (user, role)
    orgs: dict[str, list[str]] = field(default_factory=dict)  # user -> organisations
    lfs: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo -> oid -> content
    private: dict[str, bool] = field(default_factory=dict)
    puts: Counter[str] = field(default_factory=Counter)  # "repo/oid" -> completed PUTs
    commits: Counter[str] = field(default_factory=Counter)  # repo -> commits applied
    deletes: Counter[str] = field(default_factory=Counter)  # repo -> files deleted by commits
    commit_faults: list[int | Refusal | None] = field(default_factory=list)  # the next commit requests (None: ok)
    upload_faults: list[int] = field(default_factory=list)  # statuses for the next LFS PUTs
    cut_put_after: int | None = None  # cut the next LFS PUT body after N bytes (one shot)
    retry_after: str = "0"
    cas: XetCas | None = None  # the Xet tier: uploads go to this local:// CAS folder
    xet_token_faults: list[int] = field(default_factory=list)  # statuses for the next Xet token requests
    recreated: set[str] = field(default_factory=set)  # repos whose Xet-only objects a commit refuses (400)
    xet_tokens: int = 0  # Xet token requests answered
    on_commit: CommitHook | None = None
    on_request: RequestHook | None = None
    on_upload: UploadHook | None = None
    commit_requests: int = 0
    upload_requests: int = 0  # uploads seen by on_upload
    refused: int = 0  # commits refused because their parentCommit was not the branch head
    commit_lock: threading.Lock = field(default_factory=threading.Lock)  # check-and-apply of one commit at a time

    @classmethod
    def attach(cls, hub: FakeHub) -> HubWriter:
        writer = cls(hub)
        hub.writer = writer
        return writer

    def add_token(self, token: str, user: str, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = (user, role)
        self.orgs[user] = list(orgs)

    def create_repo(self, repo_id: str, files: dict[str, bytes] | None = None) -> str:
        """A repo as the hub creates it (``.gitattributes`` only), or holding ``files``; returns the commit."""
        return self.hub.push(repo_id, {".gitattributes": GITATTRIBUTES, **(files or {})})

    def head_files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        repo = self.hub.repos[repo_id]
        return dict(repo.commits[repo.branches[branch]])

    # ---- routing ---------------------------------------------------------------------------------------------
    def route(self, h: _Handler, parts: list[str], query: dict[str, str]) -> bool:
        """Answer the request if it is a write route (or whoami); False lets the read routes answer."""
        method = h.command
        if self.on_request is not None and self.on_request(method, parts) is False:
            h.close_connection = True  # dropped unanswered (the client was killed meanwhile)
            with suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return True
        if method == "GET" and parts == ["api", "whoami-v2"]:
            self._whoami(h)
        elif method == "POST" and parts == ["api", "validate-yaml"]:  # the client checks a README's metadata
            self._body(h)
            h._json(200, {"errors": [], "warnings": []})
        elif method == "POST" and parts == ["api", "repos", "create"]:
            self._create(h)
        elif method == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "branch":
            self._branch(h, f"{parts[2]}/{parts[3]}", "/".join(parts[5:]))
        elif method == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
            self._preupload(h, f"{parts[2]}/{parts[3]}", "/".join(parts[5:]))
        elif method == "GET" and len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in (
                "xet-write-token", "xet-read-token"):
            self._xet_token(h, f"{parts[2]}/{parts[3]}", write=parts[4] == "xet-write-token")
        elif method == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
            self._commit(h, f"{parts[2]}/{parts[3]}", "/".join(parts[5:]))
        elif method == "POST" and parts[-4:] == ["info", "lfs", "objects", "batch"] and parts[1].endswith(".git"):
            self._batch(h, f"{parts[0]}/{parts[1].removesuffix('.git')}")
        elif method == "PUT" and len(parts) == 4 and parts[0] == "_lfs":
            self._put(h, f"{parts[1]}/{parts[2]}", parts[3])
        else:
            return False
        return True

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _user(self, h: _Handler, write: bool) -> str | None:
        """The token's user, or None after answering 401/403."""
        auth = h.headers.get("Authorization") or ""
        entry = self.tokens.get(auth.removeprefix("Bearer ").strip())
        if entry is None:
            h._error(401, "Unauthorized", "Invalid credentials in Authorization header")
            return None
        if write and entry[1] == "read":
            h._error(403, "Forbidden", "This token has read access only")
            return None
        return entry[0]

    def _may_write(self, h: _Handler, repo_id: str) -> bool:
        user = self._user(h, write=True)
        if user is None:
            return False
        if repo_id.split("/")[0] not in (user, *self.orgs.get(user, [])):
            h._error(403, "Forbidden", f"{user} cannot write {repo_id}")
            return False
        if repo_id not in self.hub.repos:
            h._error(404, "RepoNotFound", f"{repo_id} not found")
            return False
        return True

    @staticmethod
    def _body(h: _Handler, digest: Any = None) -> bytes:
        """The request body, read through the link's upload bucket (:meth:`~hub.fakehub._Handler.read_paced`) and
        fed to ``digest`` when given."""
        if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(h.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    h.rfile.readline()
                    return bytes(out)
                out += h.read_paced(size, digest)
                h.rfile.readline()
        return h.read_paced(int(h.headers.get("Content-Length") or 0), digest)

    # ---- routes ----------------------------------------------------------------------------------------------
    def _whoami(self, h: _Handler) -> None:
        auth = (h.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        entry = self.tokens.get(auth)
        if entry is None:
            return h._error(401, "Unauthorized", "Invalid credentials in Authorization header")
        user, role = entry
        h._json(200, {"type": "user", "name": user,
                      "orgs": [{"name": o, "roleInOrg": "write"} for o in self.orgs.get(user, [])],
                      "auth": {"type": "access_token", "accessToken": {"displayName": "t", "role": role}}})

    def _create(self, h: _Handler) -> None:
        doc = json.loads(self._body(h) or b"{}")
        user = self._user(h, write=True)
        if user is None:
            return None
        namespace = doc.get("organization") or user
        repo_id = f"{namespace}/{doc['name']}"
        if namespace not in (user, *self.orgs.get(user, [])):
            return h._error(403, "Forbidden", f"{user} cannot create repos in {namespace}")
        if repo_id in self.hub.repos:
            return h._json(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
        self.create_repo(repo_id)
        self.private[repo_id] = doc.get("visibility", "private" if doc.get("private") else "public") == "private"
        h._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _branch(self, h: _Handler, repo_id: str, branch: str) -> None:
        self._body(h)
        if not self._may_write(h, repo_id):
            return None
        repo = self.hub.repos[repo_id]
        if branch in repo.branches:
            return h._error(409, "Conflict", "Reference already exists")
        repo.branches[branch] = repo.branches["main"]
        h._json(200, {})

    def _preupload(self, h: _Handler, repo_id: str, revision: str) -> None:
        doc = json.loads(self._body(h))
        if not self._may_write(h, repo_id):
            return None
        if len(doc["files"]) > PREUPLOAD_MAX_FILES:
            return h._error(400, "BadRequest", f"at most {PREUPLOAD_MAX_FILES} files per preupload call")
        repo = self.hub.repos[repo_id]
        head = repo.commits.get(repo.branches.get(unquote(revision), ""), {})
        # As the hub does, the blob id of a regular file the revision already holds: the client drops an unchanged
        # file from the commit (and skips a commit left empty, with a warning).
        files = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                  "shouldIgnore": False,
                  **({"oid": git_blob_sha1(head[f["path"]])}
                     if f["path"] in head and not f["path"].endswith(LFS_SUFFIXES) else {})} for f in doc["files"]]
        h._json(200, {"files": files, "commitOid": self.hub.repos[repo_id].branches["main"]})

    def _xet_token(self, h: _Handler, repo_id: str, write: bool) -> None:
        """The CAS endpoint and a short-lived token for it, as JSON and as the ``X-Xet-*`` headers."""
        if write and not self._may_write(h, repo_id):
            return None
        if not write and self._user(h, write=False) is None:
            return None
        with self.hub.lock:
            fault = self.xet_token_faults.pop(0) if self.xet_token_faults else None
            self.xet_tokens += 1
        if fault is not None:
            return h._error(fault, "Unauthorized" if fault in (401, 403) else "ServerError", "Xet token refused")
        if write:
            self._uploading()
        if self.cas is None:
            return h._error(404, "EntryNotFound", "this hub has no Xet storage")
        expires = int(time.time()) + 3600
        h._json(200, {"accessToken": "xet-local", "exp": expires, "casUrl": self.cas.endpoint},
                headers={"X-Xet-Endpoint": self.cas.endpoint, "X-Xet-Access-Token": "xet-local",
                         "X-Xet-Expiration": str(expires)})

    def _batch(self, h: _Handler, repo_id: str) -> None:
        doc = json.loads(self._body(h))
        if not self._may_write(h, repo_id):
            return None
        if len(doc["objects"]) > BATCH_MAX_OBJECTS:
            return h._error(400, "BadRequest", f"at most {BATCH_MAX_OBJECTS} objects per batch call")
        store = self.lfs.setdefault(repo_id, {})
        objects: list[dict[str, Any]] = []
        for obj in doc["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in store:  # an object the hub has already is never asked for again
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/_lfs/{repo_id}/{obj['oid']}", "header": {}}}
            objects.append(entry)
        h._json(200, {"transfer": "basic", "objects": objects})

    def _put(self, h: _Handler, repo_id: str, oid: str) -> None:
        with self.hub.lock:
            fault = self.upload_faults.pop(0) if self.upload_faults else None
            cut, self.cut_put_after = self.cut_put_after, None
        if cut is not None:
            self._body_prefix(h, cut)
            h.close_connection = True
            with suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return None
        sha = hashlib.sha256()
        began = time.monotonic()
        data = self._body(h, sha)
        with self.hub.lock:
            self.hub.put_spans[oid] = (began, time.monotonic())
        self._uploading()
        if fault is not None:
            return h._error(fault, "ServerError", "upload failed", retry_after=self.retry_after)
        if sha.hexdigest() != oid:
            return h._error(400, "BadRequest", "sha256 mismatch")
        remember_digest(data, oid)  # the commit that names it will not hash it again
        with self.hub.lock:
            self.lfs.setdefault(repo_id, {})[oid] = data
            self.puts[f"{repo_id}/{oid}"] += 1
        h._json(200, {})

    def _uploading(self) -> None:
        if self.on_upload is not None:
            with self.hub.lock:
                self.upload_requests += 1
                number = self.upload_requests
            self.on_upload(number)

    def _from_cas(self, repo_id: str, oid: str) -> bytes | None:
        """The object ``oid`` rebuilt from the Xet CAS when a shard registers it (and the repo may use it)."""
        if self.cas is None or repo_id in self.recreated:
            return None
        found = self.cas.lookup(oid)
        if found is None:
            return None
        data = self.cas.read(*found)
        if sha256_of(data) != oid:
            raise AssertionError(f"the CAS rebuilt {oid} as other bytes")
        with self.hub.lock:
            self.hub.xet_hashes[oid] = found[0]
        return data

    @staticmethod
    def _body_prefix(h: _Handler, n: int) -> None:
        with suppress(OSError, ValueError):
            h.read_paced(n)

    def _commit(self, h: _Handler, repo_id: str, revision: str) -> None:
        lines = [json.loads(line) for line in self._body(h).splitlines() if line.strip()]
        if not self._may_write(h, repo_id):
            return None
        with self.hub.lock:
            self.commit_requests += 1
            number = self.commit_requests
            fault = self.commit_faults.pop(0) if self.commit_faults else None
        if self.on_commit is not None and self.on_commit(number, "received") is False:
            h.close_connection = True
            with suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return None
        if isinstance(fault, Refusal):
            limits = {"RateLimit": '"api";r=0;t=1', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'}
            return h._error(fault.status, "Refused", fault.message, headers=limits if fault.ratelimit else None)
        if fault is not None:
            return h._error(fault, "ServerError", "commit failed", retry_after=self.retry_after)
        repo = self.hub.repos[repo_id]
        if revision not in repo.branches:
            return h._error(404, "RevisionNotFound", f"{revision} not found")
        parent = lines[0]["value"].get("parentCommit") if lines and lines[0]["key"] == "header" else None
        with self.commit_lock:  # the head check and the move of the branch are one step, as on the real hub
            head = repo.branches[revision]
            if parent is not None and not head.startswith(parent):
                self.refused += 1
                return h._error(412, "PreconditionFailed", PRECONDITION_FAILED)
            files = dict(repo.commits[head])
            store = self.lfs.get(repo_id, {})
            deleted = 0
            added: list[tuple[str, str]] = []
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    data = store.get(value["oid"]) or self._from_cas(repo_id, value["oid"])
                    if data is None:
                        return h._error(400, "BadRequest", MISSING_OBJECT)
                    files[value["path"]] = data
                    added.append((value["path"], value["oid"]))
                elif line["key"] == "deletedFile":
                    files.pop(value["path"], None)
                    deleted += 1
            commit = self.hub.push(repo_id, files, branch=revision)
        with self.hub.lock:
            self.commits[repo_id] += 1
            self.deletes[repo_id] += deleted
            self.hub.commit_times.append((repo_id, time.monotonic()))
            self.hub.committed_at.update({f"{repo_id}/{path}": self.hub.commit_times[-1][1] for path, _ in added})
            self.hub.committed_oids.update({f"{repo_id}/{path}": oid for path, oid in added})
        if self.on_commit is not None and self.on_commit(number, "applied") is False:
            h.close_connection = True
            with suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return None
        h._json(200, {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit}", "commitOid": commit,
                      "success": True, "pullRequestUrl": None})
