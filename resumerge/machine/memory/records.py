"""What the governor hands out and reports: reservations, and adaptations for the ledger."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

__all__ = ["Adaptation", "Reservation", "released_on_error"]


class Reservation:
    """Bytes admitted for one unit. Release when the unit's memory is freed or handed to the write buffer.

    A context manager; :meth:`release` is idempotent and may be called from any thread. ``released`` is set
    by the governor; read it, do not write it.
    """

    __slots__ = ("_on_release", "nbytes", "released", "what")

    def __init__(self, on_release: Callable[[Reservation], None], nbytes: int, what: str | None) -> None:
        self._on_release = on_release
        self.nbytes = nbytes
        self.what = what
        self.released = False

    def release(self) -> None:
        """Return the reservation to the governor and wake waiting admissions."""
        self._on_release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@contextmanager
def released_on_error(reservation: Reservation | None) -> Iterator[None]:
    """Release ``reservation`` (if any) when the block raises, and let the error go on unchanged; when the block
    ends normally the reservation is kept, for its holder to release or hand on."""
    try:
        yield
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise


@dataclass(frozen=True)
class Adaptation:
    """One change the governor made.

    ``knob`` is ``"in_flight_limit"`` or ``"admit_alone"`` (a unit admitted with
    nothing else in flight although it exceeded the headroom; ``old`` is then the headroom, ``new`` the
    estimate). ``seq`` counts adaptations from 1, so the engine persists those above the last one it wrote;
    ``at`` is the governor's clock (``time.monotonic()`` unless a test injects another); ``pool`` is
    ``"host"`` or a GPU such as ``"cuda:0"``.
    """

    seq: int
    at: float
    pool: str
    knob: str
    old: int
    new: int
    reason: str
