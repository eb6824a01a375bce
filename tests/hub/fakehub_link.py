"""A simulated network link for the stand-in hub: one token bucket per direction, shared by every request (or one
pair per connection).

``FakeHub(link=Link(down=150e6, up=75e6))`` (or ``hub.link = Link(...)`` before the client starts) paces every
response body the stand-in writes (file downloads and range reads, JSON answers) through the download bucket, and
every request body it reads (LFS object PUTs, commit payloads, the small JSON bodies of the API) through the upload
bucket, in :data:`CHUNK`-sized steps, so concurrent requests share one rate per direction as on a real link. A
direction left ``None`` is unlimited; the counters work either way. ``Link(down=..., per_connection=True)`` gives
every connection buckets of its own at those rates instead (:meth:`Link.connection`): clients on machines of their
own (a cluster's nodes, on this one machine) each get their connections' worth, as each would from its own link,
while one client's connections still add up to no more than their count times the rate.

What it does not cover: in the Xet tier (a :class:`~hub.fakehub_xet.XetCas` attached) hf_xet writes xorbs and
shards straight into the ``local://`` CAS folder, bypassing the stand-in's HTTP, so only the token request and the
commit pass the upload bucket. A throttled upload needs the LFS tier (``HF_HUB_DISABLE_XET=1``).

The counters a test or a bench reads: :attr:`Link.down_bytes` and :attr:`Link.up_bytes` (body bytes that crossed
the link), and, on the hub, the time each file's last byte was served (``FakeHub.served_at``) and the time of each
commit applied (``FakeHub.commit_times``), all on :func:`time.monotonic`.
"""

from __future__ import annotations

import threading
import time

# Bytes a body moves per bucket grant: small next to a second's worth, so pacing is smooth (4 ms at 75 MB/s), and
# large enough that the stand-in's own loop, which sleeps once per grant, stays a small load beside the merge it
# serves (64 KiB grants measured about twice its CPU per GB at 150 MB/s).
CHUNK = 256 * 1024
BURST = 4 * CHUNK  # tokens an idle bucket may save up: at most this much above the rate in any window


class TokenBucket:
    """A thread-safe token bucket: :meth:`take` blocks until ``n`` bytes may pass at ``rate`` bytes per second.

    Takers reserve in arrival order: a grant the bucket cannot cover at once drives it into debt and the taker
    sleeps until the debt would be paid, so the next taker queues behind it. Over any window the bytes granted are
    at most ``rate × window + burst`` (what an idle bucket saved, plus nothing else), and a taker never waits longer
    than the bytes queued ahead of it take at the rate.
    """

    def __init__(self, rate: float | None, burst: int = BURST, *, saved: int | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("a link rate must be positive (None: unlimited)")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst if saved is None else saved)  # what it may send at once from the start
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may cross; returns at once when unlimited."""
        if self.rate is None or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class Link:
    """Both directions of the simulated link, with the bytes that crossed each."""

    def __init__(self, down: float | None = None, up: float | None = None, burst: int = BURST, *,
                 per_connection: bool = False) -> None:
        self.down = TokenBucket(down, burst)
        self.up = TokenBucket(up, burst)
        self.per_connection = per_connection
        self.down_bytes = 0
        self.up_bytes = 0
        self._lock = threading.Lock()

    def connection(self) -> Link | ConnectionLink:
        """What paces the bodies of one new connection: this link (its buckets shared by every connection), or with
        ``per_connection`` buckets of the connection's own at this link's rates, its bytes counted here."""
        return ConnectionLink(self) if self.per_connection else self

    def send(self, n: int) -> None:
        """Pace ``n`` response-body bytes through the download bucket; call before writing them."""
        self.down.take(n)
        self.count(down=n)

    def receive(self, n: int) -> None:
        """Pace ``n`` request-body bytes through the upload bucket; call before reading them."""
        self.up.take(n)
        self.count(up=n)

    def count(self, *, down: int = 0, up: int = 0) -> None:
        """Add to the byte counters (bytes paced elsewhere: a connection's own buckets)."""
        with self._lock:
            self.down_bytes += down
            self.up_bytes += up

    def unsend(self, n: int) -> None:
        """Take back bytes counted by :meth:`send` that a failed write never delivered."""
        with self._lock:
            self.down_bytes -= n

    def reset(self) -> None:
        """Forget the byte counters (the rates stay)."""
        with self._lock:
            self.down_bytes = self.up_bytes = 0


class ConnectionLink:
    """One connection's own buckets at ``link``'s rates (see :meth:`Link.connection`); its bytes count on ``link``.
    They start empty, as a fresh TCP connection starts slow: a client opening connection after connection would
    otherwise get a burst's worth free with each."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.down = TokenBucket(link.down.rate, link.down.burst, saved=0)
        self.up = TokenBucket(link.up.rate, link.up.burst, saved=0)

    def send(self, n: int) -> None:
        """As :meth:`Link.send`, through this connection's download bucket."""
        self.down.take(n)
        self.link.count(down=n)

    def receive(self, n: int) -> None:
        """As :meth:`Link.receive`, through this connection's upload bucket."""
        self.up.take(n)
        self.link.count(up=n)

    def unsend(self, n: int) -> None:
        """As :meth:`Link.unsend`."""
        self.link.unsend(n)
