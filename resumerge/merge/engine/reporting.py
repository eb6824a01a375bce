"""What a run tells its caller as it goes (:class:`Reporter`) and how the engine says a stop was asked for
(:class:`Stopped`): the two names every stage of a run shares, the executor's pipeline, the session and each kind of
run above it."""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    """Receives progress; the CLI's implementation draws it with rich, a notebook may log it.

    One more hook is optional (looked up, so reporters written before it keep working): ``traffic(read)``, given
    once for a run on the network, where ``read()`` returns the run's :class:`~resumerge.merge.engine.traffic.Traffic`
    so far (bytes fetched and committed, both directions), to be read whenever progress is drawn.
    """

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None: ...

    def tensor_done(self, name: str, nbytes: int) -> None: ...

    def file_done(self, name: str, kind: str) -> None: ...

    def message(self, text: str) -> None: ...

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None: ...

    def memory_budget(self, nbytes: int) -> None: ...


class Stopped(Exception):
    """Raised inside the engine when a stop was requested; the caller turns it into InterruptedMerge."""
