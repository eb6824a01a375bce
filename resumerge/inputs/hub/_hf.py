"""The huggingface_hub helpers resumerge uses, the same on every supported huggingface_hub line.

Two lines are supported: 0.34-0.x, the one transformers 4.x pins (``requests`` underneath), and 1.x-2.x
(``httpx``, then ``httpx2``). Installing resumerge into a transformers-4 environment must not upgrade
huggingface_hub past what transformers accepts, so the code reads no name that only one line has except here:

- ``RemoteEntryNotFoundError``: 1.x's name for "the hub has no such file"; 0.x calls it ``EntryNotFoundError``,
  of which ``LocalEntryNotFoundError`` ("not in the cache, and offline") is a subclass there, so callers must
  catch ``LocalEntryNotFoundError`` first or test for it (:func:`is_remote_entry_missing`).
- ``TRANSPORT_ERRORS``: the exceptions of the HTTP client meaning "network trouble", not "the request is wrong".
- :func:`stream_get` and :func:`get_bytes`: one GET, the session huggingface_hub itself uses (its proxies,
  its connection pool), whatever the client underneath.
- which HTTP client is underneath (:func:`_client`), learnt from the type of ``get_session()``'s session.

``huggingface_hub.utils`` exports some helpers lazily, which mypy cannot follow, so type checking reads them
from the modules that define them; mypy checks against the installed (newest) line.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import LocalEntryNotFoundError

if TYPE_CHECKING:
    from huggingface_hub import get_session, hf_raise_for_status
    from huggingface_hub.errors import RemoteEntryNotFoundError
    from huggingface_hub.utils._fixes import WeakFileLock
    from huggingface_hub.utils._headers import build_hf_headers
    from huggingface_hub.utils._validators import validate_repo_id
else:
    # 0.x exports get_session and hf_raise_for_status from here only; 1.x-2.x from both places.
    from huggingface_hub.utils import WeakFileLock, build_hf_headers, get_session, hf_raise_for_status, validate_repo_id

    try:
        from huggingface_hub.errors import RemoteEntryNotFoundError
    except ImportError:  # huggingface_hub 0.x
        from huggingface_hub.errors import EntryNotFoundError as RemoteEntryNotFoundError


def _client() -> Any:
    """The HTTP client module huggingface_hub's session comes from (several may be installed side by side): the
    top-level module of the type of the session its public ``get_session()`` hands out (``requests`` on 0.x,
    ``httpx`` on 1.x, ``httpx2`` on 2.x), so no private module of huggingface_hub is read to learn it."""
    return importlib.import_module(type(get_session()).__module__.partition(".")[0])


def _transport_errors(client: Any) -> tuple[type[Exception], ...]:
    if client.__name__ != "requests":
        return (client.TransportError,)
    # requests wraps urllib3's read errors in these; its HTTPError (a status) is deliberately not among them.
    exc = client.exceptions
    return (exc.ConnectionError, exc.Timeout, exc.ChunkedEncodingError, exc.ContentDecodingError)


_CLIENT = _client()
TRANSPORT_ERRORS: tuple[type[Exception], ...] = _transport_errors(_CLIENT)
_USES_REQUESTS: bool = _CLIENT.__name__ == "requests"
# requests yields what it has read per chunk; without a size it may read a whole body first (a 200 to a Range
# request is a whole file, read only as far as needed).
_REQUESTS_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Fetched:
    """A whole, small response body: its status, headers (case-insensitive) and bytes."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


class Streamed:
    """An open streamed response: status, headers, the body piece by piece, and huggingface_hub's error check."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.status_code: int = response.status_code
        self.headers: Mapping[str, str] = response.headers

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        """The body as it arrives (empty keep-alive pieces left out), in pieces of ``chunk_size`` bytes (the last one
        shorter) where given, else as the client reads them."""
        if _USES_REQUESTS:
            pieces = self._response.iter_content(chunk_size or _REQUESTS_CHUNK)
        else:
            pieces = self._response.iter_bytes(chunk_size)
        yield from (chunk for chunk in pieces if chunk)

    def raise_for_hub_status(self) -> None:
        """Read the (error) body and raise huggingface_hub's error for this status, if it is one."""
        if not _USES_REQUESTS:
            self._response.read()  # the error helpers read the body
        hf_raise_for_status(self._response)


@contextmanager
def stream_get(url: str, *, headers: Mapping[str, str], timeout: float | None,
               follow_redirects: bool = True) -> Iterator[Streamed]:
    """GET ``url`` with huggingface_hub's session, the body left unread until iterated; closed on exit."""
    session: Any = get_session()
    if _USES_REQUESTS:
        with session.get(url, headers=dict(headers), timeout=timeout, stream=True,
                         allow_redirects=follow_redirects) as response:
            yield Streamed(response)
    else:
        with session.stream("GET", url, headers=dict(headers), timeout=timeout,
                            follow_redirects=follow_redirects) as response:
            yield Streamed(response)


def get_bytes(url: str, *, headers: Mapping[str, str]) -> Fetched:
    """GET ``url`` (redirects followed) with huggingface_hub's session; any status is returned, none raised."""
    session: Any = get_session()
    redirects = {"allow_redirects": True} if _USES_REQUESTS else {"follow_redirects": True}
    response = session.get(url, headers=dict(headers), **redirects)
    return Fetched(response.status_code, response.headers, bytes(response.content))


def is_remote_entry_missing(error: BaseException) -> bool:
    """Whether ``error`` says the hub has no such file (not 0.x's "not cached and offline", its subclass)."""
    return isinstance(error, RemoteEntryNotFoundError) and not isinstance(error, LocalEntryNotFoundError)


__all__ = [
    "TRANSPORT_ERRORS",
    "Fetched",
    "RemoteEntryNotFoundError",
    "Streamed",
    "WeakFileLock",
    "build_hf_headers",
    "get_bytes",
    "get_session",
    "is_remote_entry_missing",
    "stream_get",
    "validate_repo_id",
]
