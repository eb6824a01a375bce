"""HTTP byte ranges of one hub file at a pinned commit: the client that streamed inputs read through.

The ``resolve`` URL of a file is asked once; when the hub redirects (LFS and Xet files go to a signed CDN URL)
the signed URL is kept and reused for every later range, without the token (it is for the hub only), and
asked for again when the CDN answers 401/403/410 (the signature expired). Every answer is checked before a
byte is used: a 206 must carry the ``Content-Range`` asked for, a 200 (a server that ignores ``Range``) is read
only from the requested offset and dropped once the range is complete, and a body that ends early is continued
from the bytes received. Transient failures are retried with exponential backoff; 429 and 503 wait for
``Retry-After`` (capped). Nothing here writes to disk, and no URL, header or token reaches an error message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from huggingface_hub import constants

from resumerge.errors import ModelInputError
from resumerge.inputs.hub._hf import TRANSPORT_ERRORS, build_hf_headers, stream_get
from resumerge.inputs.hub.cache import HubSettings, hub_settings
from resumerge.inputs.hub.counters import FetchCounters as FetchCounters
from resumerge.inputs.hub.remote import LIBRARY, HubUnavailableError, resolve_url

_EXPIRED = (401, 403, 410)
_THROTTLED = (429, 503)
_RETRYABLE = (500, 502, 504)
_MAX_DETOURS = 4
MAX_RETRY_AFTER = 120.0  # seconds: a longer Retry-After is capped, so a run never sleeps for hours


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a range read retries before the run stops with exit 3 (resumable)."""

    attempts: int = 6
    backoff: float = 0.5  # seconds before the second attempt, doubled each time
    max_backoff: float = 8.0


@dataclass(frozen=True)
class StreamedFile:
    """A hub weight file read by range, as another machine (a cluster node) needs to find it: input ``model``'s
    ``file`` of ``repo_id`` at the pinned ``commit``, its size, and the hub's ``endpoint``. No token: whoever reads
    it uses its own. ``agent``: what its clients add to the user agent unless told otherwise (a check's actor names
    its node, as a merge's node does: :mod:`resumerge.forward.placing.rayactor`)."""

    model: str
    file: str
    repo_id: str
    commit: str
    size: int
    endpoint: str
    agent: str | None = None

    def client(self, *, counters: FetchCounters | None = None, agent: str | None = None) -> RangeClient:
        """A client reading this file's ranges from its endpoint, with this machine's token (see
        :class:`RangeClient`)."""
        settings = hub_settings(offline=False, endpoint=self.endpoint)
        return RangeClient(settings, self.repo_id, self.commit, self.file, self.size, counters=counters,
                           agent=agent if agent is not None else self.agent)


class RangeClient:
    """Reads byte ranges of ``filename`` of ``repo_id`` at ``commit`` (a 40-hex sha: never a moving branch).

    Thread-safe: several threads may read at once, each on its own pooled connection. ``sleep`` is injectable
    so a test can observe the waits without spending them. ``agent`` is added to the user agent the hub sees (a
    cluster node names itself: the hub's logs, and the stand-in's, tell the nodes apart).
    """

    def __init__(self, settings: HubSettings, repo_id: str, commit: str, filename: str, size: int, *,
                 counters: FetchCounters | None = None, policy: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep, agent: str | None = None) -> None:
        self.repo_id, self.commit, self.filename, self.size = repo_id, commit, filename, size
        self.where = f"{repo_id}@{commit[:12]}/{filename}"
        self.counters = counters or FetchCounters()
        self._resolve = resolve_url(settings, repo_id, commit, filename)
        self._hub = urlsplit(self._resolve).netloc
        self._signed: str | None = None
        self._lock = threading.Lock()
        self._policy, self._sleep, self._agent = policy, sleep, agent

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the file. Raises :class:`HubUnavailableError` after the retries are spent
        (exit 3: the run resumes), :class:`ModelInputError` when the hub no longer serves the file or the range
        lies past its end."""
        if start < 0 or end > self.size or start > end:
            raise ModelInputError(f"{self.where}: range [{start}, {end}) lies outside the {self.size}-byte file")
        data = bytearray()
        attempt = detours = 0
        # Where this read asks next, when not the URL the threads share: the hub itself after a signed URL expired,
        # or the fresh signed URL the hub then gave, which this read uses first and shares only once it served.
        # (Threads taking a fresh or expired URL from each other could use single-use or short-lived URLs up for
        # each other, one thread's detours growing while the others read.)
        mine: str | None = None
        while len(data) < end - start:
            try:
                self._read_into(data, start + len(data), end, mine)
            except _Detour as detour:
                # A redirect to the signed URL, or a fresh one after expiry: not a failure, but bounded.
                mine = detour.location
                detours += 1
                if detours > _MAX_DETOURS:
                    raise HubUnavailableError(f"reading {self.where}: the hub kept redirecting or refusing "
                                              "its signed URL", hint="resumerge resume OUT continues later") from None
            except _Retry as retry:
                attempt += 1
                if attempt >= self._policy.attempts:
                    raise HubUnavailableError(
                        f"reading {self.where} failed after {attempt} attempts ({retry.reason})",
                        hint="check the connection; resumerge resume OUT continues where it stopped",
                    ) from None
                self.counters.add(retries=1)
                self._sleep(retry.wait if retry.wait is not None else self._backoff(attempt))
        return data

    def _backoff(self, attempt: int) -> float:
        return float(min(self._policy.max_backoff, self._policy.backoff * 2 ** (attempt - 1)))

    def _url(self) -> tuple[str, bool]:
        """The URL to ask and whether it is the signed one the hub redirected to."""
        with self._lock:
            return (self._signed, True) if self._signed else (self._resolve, False)

    def _read_into(self, data: bytearray, start: int, end: int, mine: str | None = None) -> None:
        """Append to ``data`` what one request yields of ``[start, end)``, asking ``mine`` when given (this read's
        fresh signed URL, or the hub's own after an expiry), else the signed URL the threads share, else the hub's;
        raise :class:`_Retry` to go again, :class:`_Detour` with the URL to ask next."""
        url, signed = (mine, mine != self._resolve) if mine is not None else self._url()
        # The token is for the hub only; like huggingface_hub, never send it to another host (the CDN).
        headers = build_hf_headers(library_name=LIBRARY, user_agent=self._agent) \
            if urlsplit(url).netloc == self._hub else {}
        headers["Range"] = f"bytes={start}-{end - 1}"
        headers["Accept-Encoding"] = "identity"
        target = len(data) + end - start
        got = 0
        try:
            with stream_get(url, headers=headers, follow_redirects=False,
                            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                self.counters.add(requests=1)
                status = response.status_code
                if status in (301, 302, 303, 307, 308) and "location" in response.headers:
                    raise _Detour(urljoin(url, response.headers["location"]))
                self._check_status(status, url if signed else None, response.headers.get("retry-after"))
                if signed and mine is not None:
                    with self._lock:
                        self._signed = mine  # it served: the other threads may reuse it
                # A 200 is the whole file whatever was asked: skip to the range, stop once it is complete.
                skip = start if status == 200 else self._check_content_range(
                    response.headers.get("content-range"), start, end)
                for chunk in response.iter_bytes():
                    got += len(chunk)
                    if skip:
                        dropped = min(skip, len(chunk))
                        chunk, skip = chunk[dropped:], skip - dropped
                    data += chunk[: target - len(data)]
                    if len(data) >= target:
                        break
        except TRANSPORT_ERRORS as exc:
            raise _Retry(type(exc).__name__) from None
        finally:
            self.counters.add(body=got)
        if len(data) < target:
            raise _Retry("the connection ended mid-range")

    def _check_status(self, status: int, signed: str | None, retry_after: str | None) -> None:
        """Raise :class:`_Retry` for an answer worth repeating, an error for one that is final; ``signed`` is the
        signed URL that was asked (None: the hub's own)."""
        if status in (200, 206):
            return
        if status in _EXPIRED and signed is not None:
            with self._lock:
                if self._signed == signed:
                    self._signed = None  # the signature expired: ask the hub for a fresh URL
            self.counters.add(refreshed=1)
            raise _Detour(self._resolve)
        if status in _THROTTLED:
            raise _Retry(f"HTTP {status}", wait=_retry_after(retry_after))
        if status in _RETRYABLE:
            raise _Retry(f"HTTP {status}")
        if status == 416:
            raise ModelInputError(f"{self.where} is shorter on the hub than its listing says (HTTP 416)")
        if status in (401, 403):
            raise ModelInputError(f"the hub refused access to {self.where} (HTTP {status})",
                                  hint="set HF_TOKEN to a token that can read this repo")
        if status == 404:
            raise ModelInputError(f"{self.where} is no longer on the hub (HTTP 404)")
        raise _Retry(f"HTTP {status}")

    @staticmethod
    def _check_content_range(value: str | None, start: int, end: int) -> int:
        """Bytes to skip in a 206 body; raise :class:`_Retry` when it is not the range that was asked for."""
        unit, _, rest = (value or "").partition(" ")
        span = rest.partition("/")[0]
        first, _, last = span.partition("-")
        if unit != "bytes" or not first.isdigit() or not last.isdigit():
            raise _Retry("a 206 answer without a usable Content-Range")
        if int(first) > start or int(last) < end - 1:
            raise _Retry(f"the server sent bytes {span} for {start}-{end - 1}")
        return start - int(first)


class _Detour(Exception):
    """The request went to the hub for a (fresh) signed URL: ask again at once, without counting an attempt;
    ``location`` is where to ask: the signed URL the hub redirected to, or the hub itself when the one asked
    expired."""

    def __init__(self, location: str) -> None:
        super().__init__()
        self.location = location


class _Retry(Exception):
    """One attempt failed in a way that another may not; ``wait`` overrides the backoff (Retry-After)."""

    def __init__(self, reason: str, *, wait: float | None = None) -> None:
        super().__init__(reason)
        self.reason, self.wait = reason, wait


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds form), capped; None to use the backoff."""
    if value is None or not value.strip().isdigit():
        return None
    return min(MAX_RETRY_AFTER, float(value.strip()))
