"""``with`` for an object that holds something until its ``close()`` (open files, a database, a helper process, a
model's inputs): one base with the two methods every such class wrote out, so the block's end is always ``close()``,
however the block ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import TypeVar

_Self = TypeVar("_Self", bound="Closing")


class Closing(ABC):
    """An object used in a ``with`` block, closed at the block's end."""

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds (a second call does nothing)."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
