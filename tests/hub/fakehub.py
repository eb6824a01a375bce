"""A stand-in Hugging Face Hub on 127.0.0.1 for tests: standard-library HTTP server in a thread.

Serves model repos (and dataset repos, in the same namespace) through the routes the real huggingface_hub client
uses (see ``shared/reference/hf-cache.md`` §7): model info by revision, the tree listing, and ``resolve`` with the
hub's headers (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length``) and
``Range`` support. It counts the body bytes it serves per file and per request (``Request.sent``), notes when each
file's last byte went out (``served_at``) and when each commit landed (``commit_times``), logs every request, paces
every body through a simulated link (:mod:`hub.fakehub_link`; unlimited unless given a rate), and injects faults:
cutting a file's body after N bytes, stalling after N bytes until released, ignoring ``Range``, serving a file's
ranges from other bytes than its listing and whole-file answers (a stale object behind a CDN), redirecting to
signed URLs that expire after N bodies, answering 429 with ``Retry-After``.

The upload routes and their faults are :mod:`hub.fakehub_write`'s (its docstring lists every route); files
committed through Xet (:mod:`hub.fakehub_xet`) are listed with their ``xetHash`` here, as the Hub lists them.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from hub.fakehub_link import CHUNK, ConnectionLink, Link

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".onnx", ".msgpack", ".h5", ".model", ".pt")


# The most recent 256 digests, keyed by the content's identity (each entry holds its content, so the id stays its
# own): a key of the content itself would cost a SipHash of every new upload in the stand-in's GIL, 1.75 GB of it
# in a bench run, on the cores the measured client shares. Equal content held twice is hashed twice: correct.
_DIGESTS: OrderedDict[int, tuple[bytes, str]] = OrderedDict()
_DIGESTS_LOCK = threading.Lock()


def remember_digest(data: bytes, digest: str) -> None:
    """Note the sha256 of ``data`` computed elsewhere (an upload hashed as it arrived)."""
    with _DIGESTS_LOCK:
        _DIGESTS[id(data)] = (data, digest)
        _DIGESTS.move_to_end(id(data))
        while len(_DIGESTS) > 256:
            _DIGESTS.popitem(last=False)


class SparseFile(mmap.mmap):
    """A weight file served from disk, mapped read-only: a range read touches only the pages it sends, so a sparse
    checkpoint's holes (:mod:`sparse_checkpoints`) are served as zeros without being read or allocated. Its
    ``digest`` is its sha256 when it is smaller than ``hashed_below``; a larger one's stands for it (the hash of
    its header and size: the real one would read every hole), so a client that downloads such a file whole and
    checks it, as resumerge does, fails as it would if the hub served other bytes than it lists: only range reads
    are served faithfully (resumerge checks a file streamed whole too: a bench serving large files it reads whole
    hashes them, which reads their holes once)."""

    HASHED_BELOW = 64 << 20
    digest = ""

    @classmethod
    def open(cls, path: Path, hashed_below: int = HASHED_BELOW) -> SparseFile:
        fd = os.open(path, os.O_RDONLY)
        try:
            mapped = cls(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if len(mapped) < hashed_below:
            mapped.digest = hashlib.sha256(mapped).hexdigest()
        else:
            head = 8 + int.from_bytes(mapped[:8], "little")
            mapped.digest = hashlib.sha256(mapped[:head] + str(len(mapped)).encode()).hexdigest()
        return mapped


def sparse_files_of(directory: Path, hashed_below: int = SparseFile.HASHED_BELOW) -> dict[str, bytes]:
    """:func:`files_of` with every ``.safetensors`` file a :class:`SparseFile` (typed as bytes: it is served as
    bytes are), hashed below ``hashed_below`` bytes."""
    files: dict[str, Any] = files_of_small(directory)
    files.update({p.name: SparseFile.open(p, hashed_below) for p in sorted(directory.glob("*.safetensors"))})
    return files


def files_of_small(directory: Path) -> dict[str, bytes]:
    """The files of ``directory``'s top folder other than ``.safetensors``, read."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.is_file() and not p.name.endswith(".safetensors")}


def sha256_of(data: bytes) -> str:
    """The sha256 of ``data``, remembered: every ``resolve`` answer names it, and a range read of a large file
    must not cost a hash of the whole file (the real hub stores it). A :class:`SparseFile` names its own."""
    if isinstance(data, SparseFile):
        return data.digest
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(id(data))
        if known is not None and known[0] is data:
            _DIGESTS.move_to_end(id(data))
            return known[1]
    digest = hashlib.sha256(data).hexdigest()
    remember_digest(data, digest)
    return digest


def forget_digests(contents: Iterable[bytes]) -> None:
    """Drop remembered digests (the cache keeps the bytes it hashed alive), leaving the others'."""
    with _DIGESTS_LOCK:
        for data in contents:
            known = _DIGESTS.get(id(data))
            if known is not None and known[0] is data:
                del _DIGESTS[id(data)]


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file that stands for ``data`` in the repo."""
    sha = sha256_of(data)
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` as ``{posix relative path: content}``."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class _QuietServer(ThreadingHTTPServer):
    """A threading server that stays quiet when a client hangs up mid-answer.

    Kill tests SIGKILL a merge while it talks to the hub, and huggingface_hub drops keep-alive connections it no
    longer needs: the handler's write then fails with a reset or broken pipe, which socketserver prints as an
    "Exception occurred during processing of request" traceback in CI logs although nothing went wrong. Any other
    error is still printed.
    """

    def handle_error(self, request: Any, client_address: Any) -> None:
        gone = sys.exc_info()[1]
        if isinstance(gone, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            return
        super().handle_error(request, client_address)


@dataclass
class Request:
    """One request the hub answered."""

    method: str
    path: str
    range: str | None
    authorization: str | None
    status: int = 0
    sent: int = 0  # body bytes of a file served for this request (per-range byte counting)
    agent: str = ""  # the client's User-Agent (a cluster node names itself there)


@dataclass
class _Repo:
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)


class FakeHub:
    """The hub state, its counters and faults; :meth:`start` serves it on ``url``."""

    def __init__(self, link: Link | None = None) -> None:
        self.repos: dict[str, _Repo] = {}
        self.link = link or Link()  # paces and counts every body; set before start() (or between requests)
        self.served: Counter[str] = Counter()  # file body bytes per "org/name/path"
        self.served_at: dict[str, float] = {}  # "org/name/path" -> monotonic time its last body byte went out
        self.committed_at: dict[str, float] = {}  # "org/name/path" -> monotonic time a commit last added it
        self.committed_oids: dict[str, str] = {}  # "org/name/path" -> the LFS oid a commit last gave it
        self.put_spans: dict[str, tuple[float, float]] = {}  # LFS oid -> monotonic times its upload began and ended
        self.commit_times: list[tuple[str, float]] = []  # (repo, monotonic time) of every commit applied
        self.api_bytes = 0  # JSON bodies of the API routes and error bodies
        self.requests: list[Request] = []
        self.drop_after: dict[str, int] = {}  # "org/name/path" -> cut the next body after N bytes (one shot)
        self.hold_after: dict[str, tuple[int, threading.Event]] = {}  # stall after N bytes until the event
        self.ignore_range = False
        self.ranges_from: dict[str, bytes] = {}  # "org/name/path" -> answer its Range GETs from these bytes
        # Issue-15 faults: resolve GETs redirect to a signed URL valid for this many bodies (then 403, like an
        # expired CDN signature); the next N ranged GETs answer 429 with Retry-After.
        self.signed_uses: int | None = None
        self.throttle = 0
        self.retry_after = "1"
        self.expired = 0  # 403s sent for spent signatures
        self._signatures: dict[str, tuple[str, str, str, int]] = {}
        self.lock = threading.Lock()
        self.writer: Any = None  # the upload side (hub.fakehub_write.HubWriter) when attached
        self.xet_hashes: dict[str, str] = {}  # sha256 -> Xet hash of the objects committed through Xet
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self._counter = 0

    # ---- repo contents -------------------------------------------------------------------------------------
    def push(self, repo_id: str, files: Mapping[str, bytes], branch: str = "main") -> str:
        """Create a commit of ``repo_id`` holding exactly ``files`` and move ``branch`` to it; return its sha."""
        # Remembered digests, outside the lock: a commit of many large files must not rehash them all (nor stall
        # every transfer meanwhile), as each of a run's commits repeats the files of the ones before.
        digests = {path: sha256_of(data) for path, data in files.items()}
        with self.lock:
            self._counter += 1
            digest = hashlib.sha1(f"{repo_id}:{self._counter}".encode())
            for path in sorted(files):
                digest.update(path.encode() + b"\0" + digests[path].encode())
            commit = digest.hexdigest()
            repo = self.repos.setdefault(repo_id, _Repo())
            repo.commits[commit] = dict(files)
            repo.branches[branch] = commit
            return commit

    def reset_counters(self) -> None:
        """Forget served bytes, their times, commit times, the link's byte counts and the request log."""
        with self.lock:
            self.served.clear()
            self.served_at.clear()
            self.committed_at.clear()
            self.committed_oids.clear()
            self.put_spans.clear()
            self.commit_times.clear()
            self.api_bytes = 0
            self.requests.clear()
        self.link.reset()

    def drop(self, repo_id: str) -> None:
        """Forget a repo and the objects uploaded to it (a bench frees a merged output's bytes this way)."""
        with self.lock:
            repo = self.repos.pop(repo_id, None)
            uploaded = self.writer.lfs.pop(repo_id, {}) if self.writer is not None else {}
        commits = repo.commits.values() if repo is not None else ()
        forget_digests([*uploaded.values(), *(data for files in commits for data in files.values())])

    def file_bytes(self) -> dict[str, int]:
        """Served body bytes per file, only files that were served at all."""
        with self.lock:
            return {k: v for k, v in self.served.items() if v}

    # ---- server lifecycle ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start() the hub first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        """Serve on 127.0.0.1 on a free port, in a daemon thread."""
        handler = type("BoundHandler", (_Handler,), {"hub": self})
        self._server = _QuietServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and cut every open connection (keep-alive ones included)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self.lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _, event in self.hold_after.values():
            event.set()
        assert self._thread is not None
        self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- lookups used by the handler -----------------------------------------------------------------------
    def commit_of(self, repo_id: str, revision: str) -> str | None:
        repo = self.repos[repo_id]
        if revision in repo.branches:
            return repo.branches[revision]
        return revision if revision in repo.commits else None

    def tree(self, repo_id: str, commit: str, under: str, recursive: bool) -> list[dict[str, object]]:
        files = self.repos[repo_id].commits[commit]
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        entries: dict[str, dict[str, object]] = {}
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :].split("/")
            depth = len(rest) if recursive else 1
            for i in range(1, min(depth, len(rest) - 1) + 1):  # folders on the way
                folder = prefix + "/".join(rest[:i])
                entries.setdefault(folder, {"type": "directory", "path": folder, "oid": git_blob_sha1(folder.encode())})
            if recursive or len(rest) == 1:
                entries[path] = self.file_entry(path, files[path])
        return list(entries.values())

    def file_entry(self, path: str, data: bytes) -> dict[str, object]:
        if path.endswith(LFS_SUFFIXES):
            pointer = lfs_pointer(data)
            entry: dict[str, object] = {
                "type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(pointer),
                "lfs": {"oid": sha256_of(data), "size": len(data), "pointerSize": len(pointer)},
            }
            xet_hash = self.xet_hashes.get(sha256_of(data))
            if xet_hash is not None:  # the real Hub lists it beside the LFS sha256 for Xet-stored files
                entry["xetHash"] = xet_hash
            return entry
        return {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle and delayed ACKs add 40 ms per request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.hub.lock:
            self.hub._sockets.add(self.connection)

    def finish(self) -> None:
        with suppress(OSError):
            super().finish()
        with self.hub.lock:
            self.hub._sockets.discard(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_POST(self) -> None:
        self._dispatch(head=False)

    def do_PUT(self) -> None:
        self._dispatch(head=False)

    # ---- routing -------------------------------------------------------------------------------------------
    def _dispatch(self, head: bool) -> None:
        split = urlsplit(self.path)
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        self._record = Request(self.command, split.path, self.headers.get("Range"), self.headers.get("Authorization"),
                               agent=self.headers.get("User-Agent", ""))
        with self.hub.lock:
            self.hub.requests.append(self._record)
        query = {k.lower(): v[-1] for k, v in parse_qs(split.query).items()}
        # A dataset repo's routes are a model repo's with "datasets" in them; here both share one namespace.
        if parts[:2] == ["api", "datasets"]:
            parts[1] = "models"
        elif parts[:1] == ["datasets"]:
            parts = parts[1:]
        if self.hub.writer is not None and self.hub.writer.route(self, parts, query):
            return
        if len(parts) >= 3 and parts[0] == "api" and parts[1] == "models":
            self._api(parts[2:], query)
        elif len(parts) >= 5 and parts[2] == "resolve":
            if not head and self._detour(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])):
                return
            self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        elif len(parts) == 2 and parts[0] == "_signed":
            self._signed(parts[1], head)
        else:
            self._error(404, "EntryNotFound", f"unknown route {split.path}")

    def _detour(self, repo_id: str, revision: str, path: str) -> bool:
        """Answer 429 (throttled) or a redirect to a signed URL instead of the body, when those faults are on."""
        with self.hub.lock:
            throttled = self.hub.throttle > 0 and self.headers.get("Range") is not None
            if throttled:
                self.hub.throttle -= 1
            uses = self.hub.signed_uses
            token = hashlib.sha1(f"{len(self.hub._signatures)}:{repo_id}:{path}".encode()).hexdigest()
            if not throttled and uses is not None:
                self.hub._signatures[token] = (repo_id, revision, path, uses)
        if throttled:
            self._error(429, "TooManyRequests", "slow down", retry_after=self.hub.retry_after)
            return True
        if uses is None:
            return False
        self._record.status = 302
        self.send_response(302)
        self.send_header("Location", f"/_signed/{token}")
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def _signed(self, token: str, head: bool) -> None:
        """The CDN side: serve the signed file while the signature has uses left, else 403."""
        with self.hub.lock:
            repo_id, revision, path, left = self.hub._signatures.get(token, ("", "", "", 0))
            if left > 0:
                self.hub._signatures[token] = (repo_id, revision, path, left - 1)
            else:
                self.hub.expired += 1
        if left <= 0:
            return self._error(403, "SignatureExpired", "signature expired")
        self._resolve(repo_id, revision, path, head)

    def _api(self, parts: list[str], query: dict[str, str]) -> None:
        if len(parts) < 2:
            return self._error(404, "RepoNotFound", "no repo")
        repo_id, rest = f"{parts[0]}/{parts[1]}", parts[2:]
        if repo_id not in self.hub.repos:
            return self._error(404, "RepoNotFound", f"{repo_id} not found")
        revision = rest[1] if len(rest) >= 2 else "main"
        commit = self.hub.commit_of(repo_id, revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"{revision} not found")
        if not rest or rest[0] == "revision":
            files = self.hub.repos[repo_id].commits[commit]
            body: object = {"_id": repo_id, "id": repo_id, "sha": commit, "private": False,
                            "siblings": [{"rfilename": p} for p in sorted(files)]}
        elif rest[0] == "tree":
            recursive = query.get("recursive", "false").lower() == "true"
            body = self.hub.tree(repo_id, commit, "/".join(rest[2:]), recursive)
        else:
            return self._error(404, "EntryNotFound", f"unknown api route {rest[0]}")
        self._json(200, body)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        if repo_id not in self.hub.repos:
            return self._error(404, "RepoNotFound", f"{repo_id} not found")
        commit = self.hub.commit_of(repo_id, revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"{revision} not found")
        data = self.hub.repos[repo_id].commits[commit].get(path)
        if data is None:
            return self._error(404, "EntryNotFound", f"{path} not found", commit=commit)
        entry = self.hub.file_entry(path, data)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{entry["oid"]}"', "Accept-Ranges": "bytes"}
        if "lfs" in entry:
            headers["X-Linked-Etag"] = f'"{sha256_of(data)}"'
            headers["X-Linked-Size"] = str(len(data))
        start, end, status = 0, len(data), 200
        wanted = self.headers.get("Range")
        if wanted and not head and not self.hub.ignore_range:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start = int(first)
            end = min(len(data), int(last) + 1) if last else len(data)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data = self.hub.ranges_from.get(f"{repo_id}/{path}", data)  # listed and sized as the real file
        self._record.status = status
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if not head:
            self._send_body(f"{repo_id}/{path}", memoryview(data)[start:end])  # a view: no copy of a large file

    @property
    def link(self) -> Link | ConnectionLink:
        """What paces this connection's bodies: the hub's link, or this connection's own buckets at its rates (a
        link ``per_connection``), made on first use and again whenever the hub's link is replaced."""
        made = getattr(self, "_link", None)
        if made is None or made[0] is not self.hub.link:
            made = self._link = (self.hub.link, self.hub.link.connection())
        return made[1]

    def write_paced(self, raw: bytes | memoryview) -> None:
        """Write a response body through the link's download bucket, a chunk at a time."""
        for at in range(0, len(raw), CHUNK):
            piece = raw[at : at + CHUNK]
            self.link.send(len(piece))
            try:
                self.wfile.write(piece)
            except OSError:
                self.link.unsend(len(piece))
                raise

    def read_paced(self, n: int, digest: Any = None) -> bytes:
        """Read ``n`` request-body bytes (fewer at EOF) through the link's upload bucket, a chunk at a time, fed to
        ``digest`` (a hashlib object) as they arrive, so checking a large upload costs no time after its end."""
        # A chunk at a time into its own bytes, joined at the end: the socket read faults in each chunk's fresh
        # pages and bytes.join copies a large body with the GIL released. A body-sized bytearray filled in place
        # and copied into bytes held this process's GIL through two passes over fresh memory, 0.2 s per 100 MB
        # on a VM, which stalled every other transfer of the stand-in (the link then idled: the harness, not
        # the client, was measured).
        pieces: list[bytes] = []
        got = 0
        while got < n:
            step = min(CHUNK, n - got)
            self.link.receive(step)
            piece = self.rfile.read(step)
            if digest is not None:
                digest.update(piece)
            pieces.append(piece)
            got += len(piece)
            if len(piece) < step:
                break
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _send_body(self, key: str, body: bytes | memoryview) -> None:
        with self.hub.lock:
            cut = self.hub.drop_after.pop(key, None)
            hold = self.hub.hold_after.get(key)
        limit = len(body) if cut is None else min(cut, len(body))
        sent = 0
        try:
            while sent < limit:
                if hold is not None and sent >= hold[0]:
                    hold[1].wait(timeout=30)
                    hold = None
                step = min(CHUNK, limit - sent, (hold[0] - sent) if hold is not None else CHUNK)
                self.link.send(step)  # wait for the link first: the bytes go out when it grants them
                # Count before writing: once the client has the bytes it may go on (and a test may reset the
                # counters) before this thread runs again. A failed write is taken back.
                with self.hub.lock:
                    self.hub.served[key] += step
                    self.hub.served_at[key] = time.monotonic()
                    self._record.sent += step
                try:
                    self.wfile.write(body[sent : sent + step])
                except OSError:
                    self.link.unsend(step)
                    with self.hub.lock:
                        self.hub.served[key] -= step
                        self._record.sent -= step
                    raise
                sent += step
        except OSError:
            self.close_connection = True
            return
        if cut is not None:
            # Drop the connection mid-body: the client sees fewer bytes than Content-Length promised.
            self.close_connection = True
            with suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _json(self, status: int, body: object, headers: Mapping[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        self._record.status = status
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.write_paced(raw)
            with self.hub.lock:
                self.hub.api_bytes += len(raw)

    def _error(self, status: int, code: str, message: str, commit: str | None = None,
               retry_after: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        said = dict(headers or {})
        if retry_after is not None:
            said["Retry-After"] = retry_after
        said |= {"X-Error-Code": code, "X-Error-Message": message}
        if commit is not None:
            said["X-Repo-Commit"] = commit
        self._json(status, {"error": message}, said)


def iter_requests(hub: FakeHub, method: str | None = None) -> Iterator[Request]:
    """The logged requests, optionally of one method."""
    with hub.lock:
        log = list(hub.requests)
    return (r for r in log if method is None or r.method == method)
