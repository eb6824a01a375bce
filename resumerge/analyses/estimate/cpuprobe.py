"""What moving one byte over the network costs this machine's cores, measured in a fraction of a second.

A downloaded byte of a hub input is received from a socket, written into the HF cache, hashed against the hub's
checksum and read back by the merge; a byte of an ``hf://`` OUT is written to staging, hashed, read back by the
upload and sent. On a machine of few cores that work competes with the merge for the same cores: on the project's
2-core machine a default hub-to-hub run at 150/75 MB/s spent more CPU on its transfers than on the merge, and the
link alone underestimated its wall by a third (bench/RESULTS.md). ``plan``'s network estimate therefore adds it.

:func:`probe_transfer_cost` does those steps on a small buffer, three times (the median counts): a socket pair
carrying it in 64 KiB receives, a temp file (resumerge's probe name, always deleted) written in a download's pieces
and read back into fresh buffers, sha256. It counts CPU time (``time.thread_time``), not wall time, so other
processes do not inflate it. What it leaves out: the HTTP client's own per-response work, a paced link's (bytes
that trickle in cost more CPU than a burst: 2.8-3.3 s against 1.65-1.8 s per GB measured at 150 MB/s) and a
loaded machine's contention, so it is a lower bound.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from resumerge.inputs.hub.counters import DOWNLOAD_CHUNK
from resumerge.machine.diskprobe import PROBE_PREFIX

PROBE_BYTES = 16 * 2**20
ROUNDS = 3  # the median of three: about 0.2 s of CPU on the 2-core bench machine for the default size
_RECEIVE = 64 * 1024  # what the HTTP client asks the socket for at a time
_PIECE = DOWNLOAD_CHUNK  # what a download writes at a time


@dataclass(frozen=True)
class TransferCost:
    """CPU seconds per byte this machine spends on a downloaded byte (``down``) and an uploaded one (``up``)."""

    down: float
    up: float

    def seconds(self, down_bytes: int, up_bytes: int) -> float:
        """CPU seconds for moving ``down_bytes`` in and ``up_bytes`` out."""
        return down_bytes * self.down + up_bytes * self.up


def probe_transfer_cost(directory: Path, nbytes: int = PROBE_BYTES, rounds: int = ROUNDS) -> TransferCost | None:
    """Time the CPU work of a transfer on ``nbytes`` bytes in ``directory`` (which exists), ``rounds`` times, and take
    each direction's median; None when it cannot run there.

    One round alone is at the mercy of the kernel's state: measured right after another process had loaded 3.5 GB,
    a first round cost 3.4 times what the next ones did (8.3-9.7 s for the bench's 5.25 GB against 33 s), so a
    ``plan`` after a big job read the transfers' CPU as double and called a link-bound run compute-bound.
    """
    if nbytes < _PIECE or rounds < 1:
        return None
    data = os.urandom(_PIECE) * (nbytes // _PIECE)
    costs = []
    for _ in range(rounds):
        cost = _one_round(directory, data)
        if cost is None:
            return None
        costs.append(cost)
    return TransferCost(down=statistics.median(c.down for c in costs), up=statistics.median(c.up for c in costs))


def _one_round(directory: Path, data: bytes) -> TransferCost | None:
    """One round of the probe over ``data``: CPU seconds per byte each way, or None when it cannot run there."""
    path = directory / f"{PROBE_PREFIX}{secrets.token_hex(6)}.part"
    try:
        pieces, receive, send = _through_socket(data)
        started = time.thread_time()
        with open(path, "wb") as f:
            for piece in pieces:
                f.write(piece)
                f.flush()
        write = time.thread_time() - started
        started = time.thread_time()
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        hashing = time.thread_time() - started
        started = time.thread_time()
        fd = os.open(path, os.O_RDONLY)
        try:
            for at in range(0, len(data), _PIECE):
                os.pread(fd, _PIECE, at)
        finally:
            os.close(fd)
        read = time.thread_time() - started
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    n = len(data)
    return TransferCost(down=(receive + write + hashing + read) / n, up=(write + hashing + read + send) / n)


def _through_socket(data: bytes) -> tuple[list[bytes], float, float]:
    """Send ``data`` through a local socket pair; returns it as received in a download's pieces, and the CPU seconds of
    the receiving and of the sending thread."""
    ours, theirs = socket.socketpair()
    sent = [0.0]

    def send() -> None:
        started = time.thread_time()
        with contextlib.suppress(OSError):
            theirs.sendall(data)
        sent[0] = time.thread_time() - started
        theirs.close()

    sender = threading.Thread(target=send, name="resumerge-probe", daemon=True)
    started = time.thread_time()
    sender.start()
    pieces: list[bytes] = []
    parts: list[bytes] = []
    held = 0
    try:
        while chunk := ours.recv(_RECEIVE):
            parts.append(chunk)
            held += len(chunk)
            if held >= _PIECE:
                pieces.append(b"".join(parts))
                parts, held = [], 0
    finally:
        ours.close()
    if parts:
        pieces.append(b"".join(parts))
    received = time.thread_time() - started
    sender.join()
    return pieces, received, sent[0]
