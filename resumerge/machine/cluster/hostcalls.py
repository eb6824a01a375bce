"""A kept worker's side of the forward pass's actor it hosts (:mod:`~resumerge.machine.cluster.hosting`): the calls
of the lease that holds the worker run one at a time, in the order the driver sent them (a kept worker runs its calls
on threads, where a pass's protocol needs a one-thread actor's order), those of an ended lease refused, and the pass's
object dropped when the lease ends, so the next pass starts as a fresh actor would. Imports nothing of the engine:
the worker's actor makes one as it starts. Where no worker is kept, a :class:`Hosting` is the pass's fresh actor itself
(:func:`~resumerge.machine.cluster.hosting.fresh_host`, under a lease of its own): every pass's object on a node
(a model's, a search's group of candidates) is made and called by this one class.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any


class EndedLease(RuntimeError):
    """A call of a lease that no longer holds the worker (its pass ended, or its driver died)."""


class Hosting:
    """A kept worker's hosted pass object, for the lease that holds the worker (:meth:`begin`); see the module's
    docstring."""

    def __init__(self) -> None:
        self.turn = threading.Condition()
        self.lease: str | None = None  # the token (its hex) of the lease whose calls run
        self.next = 0  # the number of the call of that lease to run next
        self.hosted: Any = None
        self.failed: BaseException | None = None  # what the pass's object raised as it was made

    def begin(self, lease: str) -> None:
        """The lease of token ``lease`` holds the worker: its calls run from number 0."""
        with self.turn:
            self.lease, self.next, self.hosted, self.failed = lease, 0, None, None
            self.turn.notify_all()

    def end(self) -> None:
        """The lease ended: its object closed (once its running call returned) and dropped; its waiting calls
        refused."""
        with self.turn:
            hosted, self.hosted, self.lease, self.failed = self.hosted, None, None, None
            self.turn.notify_all()
        close = getattr(hosted, "close", None)
        if callable(close):
            # (an object whose making failed half-way may fail to close) it is dropped all the same: its files
            # close as it is collected, and the next lease makes its own
            with contextlib.suppress(Exception):
                close()

    def host(self, lease: str, seq: int, factory: Callable[..., Any], *args: Any) -> None:
        """Call ``seq`` of ``lease``: the pass's object made as ``factory(*args)``; what that raises is raised by
        the calls after it (not by this one, whose answer the driver does not read: Ray would print the error of an
        answer nobody read)."""

        def made() -> None:
            try:
                self.hosted = factory(*args)
            except Exception as exc:
                self.failed = exc

        self._in_turn(lease, seq, made)

    def call(self, lease: str, seq: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``seq`` of ``lease``: the pass's object's method ``name``."""

        def called() -> Any:
            if self.hosted is None:
                raise self.failed or EndedLease("the pass's object was not made")
            return getattr(self.hosted, name)(*args, **kwargs)

        return self._in_turn(lease, seq, called)

    def _in_turn(self, lease: str, seq: int, run: Callable[[], Any]) -> Any:
        with self.turn:
            while self.lease == lease and self.next != seq:
                self.turn.wait()
            if self.lease != lease:
                raise EndedLease("this lease of the kept worker ended")
            try:
                return run()
            finally:
                self.next += 1
                self.turn.notify_all()
