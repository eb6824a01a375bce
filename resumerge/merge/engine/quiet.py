"""The run nobody watches or stops: a reporter that shows nothing and a stop flag that never turns (library use,
``--quiet``, and a cluster worker, whose progress is the driver's to show)."""

from __future__ import annotations


def never_stop() -> bool:
    """The stop flag of a run nobody stops."""
    return False


class NullReporter:
    """A reporter that shows nothing (library use, ``--quiet``)."""

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        """Ignore."""

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Ignore."""

    def file_done(self, name: str, kind: str) -> None:
        """Ignore."""

    def message(self, text: str) -> None:
        """Ignore."""

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None:
        """Ignore."""

    def memory_budget(self, nbytes: int) -> None:
        """Ignore."""
