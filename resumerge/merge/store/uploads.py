"""The threads a hub output's uploads run on (:class:`~resumerge.merge.store.hubcommits.CommitQueue`'s): daemon
threads, so a stopped process never waits for a transfer in flight."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class DaemonUploads:
    """A few daemon threads that run uploads: unlike a ThreadPoolExecutor's, they never hold up the exit of a
    stopped process (the resume sends again what was cut short: the whole object through LFS, the chunks the CAS
    lacks through Xet)."""

    def __init__(self, workers: int) -> None:
        self.jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None] = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name="resumerge-upload", daemon=True)
                        for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        self.jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

    def shutdown(self, *, wait: bool) -> None:
        """Cancel the uploads not started; with ``wait``, let the running ones finish."""
        with contextlib.suppress(queue.Empty):
            while True:
                job = self.jobs.get_nowait()
                if job is not None:
                    job[0].cancel()
        for _ in self.threads:
            self.jobs.put(None)
        if wait:
            for thread in self.threads:
                thread.join()
