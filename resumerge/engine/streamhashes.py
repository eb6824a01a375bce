"""Integrity of streamed input bytes: every range read by HTTP Range is hashed and checked against the ledger.

A streamed tensor never lands on disk, so it cannot be verified the way a download is (one sha256 over the
file). Instead its sha256 is recorded in the run's ledger when it is first read; any later read of the same
range — a resume after a kill, on this machine or another — must give the same bytes, or the run stops with
exit 4 naming the file. The file itself is pinned by commit, and its hub sha256 is part of the plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from resumerge.engine.streamdigest import FileDigest, StreamedInputChanged

if TYPE_CHECKING:
    from resumerge.store.ledger import Ledger


class StreamHashes:
    """Checks streamed ranges against the ledger once one is attached (before that, nothing is read)."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None
        self.after: Callable[[], None] | None = None  # called after each range is checked (progress)
        self.digests: dict[tuple[str, str], FileDigest] = {}  # files this run reads whole: checked entire

    def check(self, model: str, file: str, start: int, end: int, data: bytearray) -> None:
        """Record the sha256 of ``data`` (bytes ``[start, end)`` of ``file`` of ``model``), or compare it with
        the recorded one. Raises :class:`StreamedInputChanged` on a mismatch."""
        self.check_digest(model, file, start, end, hashlib.sha256(data).hexdigest())
        whole = self.digests.get((model, file))
        if whole is not None:
            whole.feed(start, data)
        if self.after is not None:
            self.after()

    def check_digest(self, model: str, file: str, start: int, end: int, digest: str) -> None:
        """Record ``digest``, the sha256 of bytes ``[start, end)`` of ``file`` of ``model`` (read here, or on a
        cluster node), or compare it with the recorded one. Raises :class:`StreamedInputChanged` on a mismatch."""
        if self.ledger is None:
            raise RuntimeError("internal: a streamed input was read before the run's ledger was attached")
        recorded = self.ledger.remember_read(model, file, start, end, digest)
        if recorded != digest:
            raise StreamedInputChanged(
                f"input {model} file {file} gave other bytes for [{start}, {end}) than when this run first read "
                "them; nothing from it was merged",
                path=file,
                hint="the hub served changed content for a pinned commit; retry later, or start over with "
                     "resumerge run CONFIG OUT --restart",
            )
