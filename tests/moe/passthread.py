"""The prompt work of the hidden-state gate modes done on a thread of the test's process, for tests whose subject
is what the pass computes (its bits against mergekit's), not the process it runs in.

A run starts a process for the pass (:class:`resumerge.runs.moe.passproc.PassProcess`): an interpreter that imports
torch and transformers, about 6 CPU seconds, for a pass that takes a fraction of one on the tiny models here.
:func:`passes_on_a_thread` puts :class:`PassOnAThread` in its place: the same job, read back from the same JSON,
done by the same function (:func:`resumerge.runs.moe.passmain.answer`) in this process, which imports transformers once
for all its passes. What the process adds is tested with real processes: transformers never enters the run's
process and a killed run's pass dies with it (tests/moe/test_resume.py), the pass's refusal and memory
(tests/moe/test_surface.py), its errors and deaths read back (tests/moe/test_passproc.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from resumerge.machine.memory import allocator
from resumerge.runs.moe import passmain, passproc

_THREAD = "test-prompt-pass"


class PassOnAThread:
    """:class:`~resumerge.runs.moe.passproc.PassProcess`'s interface, its job done on a thread of this process."""

    def __init__(self, where: Path | None = None, *, given: bool = False) -> None:
        self._thread: threading.Thread | None = None
        self._answer: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._checked = threading.Event()  # set when the job made its checks, or ended
        self._said_checked = False

    def send(self, job: dict[str, Any], workdir: Path) -> None:
        """Start ``job`` as the process would read it: JSON, with its workdir and the run's process id. Its share
        of the budget is left out: this process holds the test's imports besides the pass's (the share is
        checked where the pass has its process, tests/moe/test_surface.py). A torch thread count (``-j``) is
        refused: the pass sets it with ``torch.set_num_threads``, for the whole process, where it would outlive
        the pass (its process ends with it)."""
        assert job["job"] != "probe", "the probe measures what its own process holds: it needs that process"
        assert not job.get("threads"), "a pass with its own torch threads (-j) needs its own process"
        doc = json.loads(json.dumps({**job, "workdir": str(workdir), "parent": os.getpid()}))
        doc.pop("share", None)
        self._thread = threading.Thread(target=self._run, args=(doc,), name=_THREAD, daemon=True)
        self._thread.start()

    def _run(self, doc: dict[str, Any]) -> None:
        def checked() -> None:
            self._said_checked = True
            self._checked.set()

        try:
            self._answer = passmain.answer(doc, Path(doc["workdir"]), checked)
        except BaseException as exc:  # raised again by result(), as the process's would be
            self._error = exc
        finally:
            self._checked.set()

    def checked(self) -> None:
        """Wait until the job made its checks; raises its error when one failed."""
        self._checked.wait()
        if not self._said_checked:
            self.result()

    def running(self) -> bool:
        """Whether the job was sent and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the job's end; True once it has ended."""
        assert self._thread is not None, "no job was sent"
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """A thread cannot be killed: wait for the job (a pass over a tiny model) to end."""
        if self._thread is not None:
            self._thread.join()

    def result(self) -> dict[str, Any]:
        """The job's answer; raises its error again."""
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


@contextmanager
def passes_on_a_thread() -> Iterator[None]:
    """Within the block, every run's prompt work is done by :class:`PassOnAThread`; the allocator settings the
    pass's process makes for itself for good are not made on its thread (they would outlive the pass here)."""
    tune = allocator.tune_allocator

    def tune_but_not_for_the_pass() -> Callable[[], None] | None:
        return None if threading.current_thread().name == _THREAD else tune()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(passproc, "PassProcess", PassOnAThread)
        patch.setattr(allocator, "tune_allocator", tune_but_not_for_the_pass)
        yield
