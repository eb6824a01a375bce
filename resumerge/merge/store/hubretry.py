"""Retries, quota waits and commit pacing for calls to a hub repo.

429, 5xx and network errors are retried with exponential backoff (``Retry-After`` honoured when the server sends
one). The hub's commit quota (429 "…rate limit for repository commits (N per hour)…") is no failure: the user is
told until when and the call waits for the window, as often as the hub asks. :func:`pace_wait` keeps this process
under ``hourly`` commits in any hour so the quota is rarely met at all.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from resumerge.errors import ResumergeError
from resumerge.merge.store.hubrepo import HubRepo, commit_quota, hub_failure, is_retryable, quota_wait

T = TypeVar("T")
ATTEMPTS = 6
BASE_WAIT = 1.0
MAX_WAIT = 60.0

WINDOW = 3600.0


def with_retries(repo: HubRepo, what: str, call: Callable[[], T], *, resume: str,
                 sleep: Callable[[float], None] = time.sleep, tell: Callable[[str], None] | None = None) -> T:
    """``call()``, retried on 429/5xx/network errors with exponential backoff (``Retry-After`` wins when sent).

    The hub's commit quota (429 "…rate limit for repository commits (N per hour)…") is no failure: ``tell`` (the
    user, on stderr by default) hears when the window lets a commit through, ``sleep`` waits for it, and the call
    is tried again, as often as the hub asks (a stopped run abandons the wait: its ``sleep`` raises). Raises the
    exit-3 error of :func:`~resumerge.merge.store.hubrepo.hub_failure` when it keeps failing or the token is refused.
    """
    attempt = 0
    while True:
        try:
            return call()
        except ResumergeError:
            raise  # already the user's error (another writer moved the branch)
        except Exception as exc:
            quota = commit_quota(exc)
            if quota is not None:
                wait = quota_wait(exc)
                until = time.strftime("%H:%M", time.localtime(time.time() + wait))
                (tell or to_stderr)(f"the hub allows {quota} commits an hour to {repo.target.url}; waiting until "
                                     f"{until}, Ctrl-C is safe (then {resume})")
                sleep(wait)
                continue
            if not is_retryable(exc) or attempt == ATTEMPTS - 1:
                raise hub_failure(repo, what, exc, resume=resume) from exc
            sleep(_wait(exc, attempt))
            attempt += 1


def pace_wait(recent: deque[float], now: float, hourly: int, *, burst: int | None = None,
              spacing: float = 0.0) -> float:
    """Seconds from ``now`` until one more commit keeps at most ``hourly`` commits in any hour (0: at once), given
    the times of this process's ``recent`` commits, oldest first; the times that left the hour are dropped. Past
    ``burst`` commits in the last hour, a commit also waits until ``spacing`` seconds after the latest one."""
    while recent and recent[0] <= now - WINDOW:
        recent.popleft()
    wait = 0.0 if len(recent) < hourly else recent[0] + WINDOW - now
    if burst is not None and spacing and len(recent) >= burst:
        wait = max(wait, recent[-1] + spacing - now)
    return max(0.0, wait)


def to_stderr(text: str) -> None:
    print(f"resumerge: {text}", file=sys.stderr, flush=True)


def _wait(exc: BaseException, attempt: int) -> float:
    """Seconds to wait before the next attempt: the server's ``Retry-After`` (seconds form) when it sent one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    header = str(headers.get("Retry-After", "")) if headers is not None else ""
    if header.strip().isdigit():
        return min(float(header), MAX_WAIT)
    return float(min(BASE_WAIT * 2**attempt, MAX_WAIT))
