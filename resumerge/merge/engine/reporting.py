"""What a run tells its caller as it goes (:class:`Reporter`), how the engine says a stop was asked for
(:class:`Stopped`) and how the caller drives a run (:class:`Driving`): the names every stage of a run shares, the
executor's pipeline, the session and each kind of run above it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from resumerge.merge.engine.quiet import never_stop


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


@dataclass(frozen=True)
class Driving:
    """How a run is driven: ``restart`` an earlier different run in OUT, show progress on ``reporter``, stop once
    ``should_stop`` turns true; a recipe's ``intermediate_dir`` and ``cleanup`` of its intermediates."""

    should_stop: Callable[[], bool]
    reporter: Reporter | None = None
    restart: bool = False
    intermediate_dir: str | os.PathLike[str] | None = None
    cleanup: bool = False


# A run nobody stops nor watches, that keeps what OUT holds (a library call's default).
UNDRIVEN = Driving(never_stop)
