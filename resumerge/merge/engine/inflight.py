"""The engine's groups of units between its compute pool and its writer: started in order, handed over in order.

A worker whose group finished takes the next group at once, even while an older one still computes: the writer
takes the groups in order all the same, and a worker left waiting for the oldest group sat idle (a block-FP8 merge
on 2 cores: a small projection finished beside a large one for about a tenth of the compute). Each group is computed
as it would be anyway, in the same threads' settings, so bytes, ledger and resume are unchanged; only when each one
starts moves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Generic, Protocol, TypeVar

from resumerge.machine.memory import Reservation, released_on_error

# Units (a tensor, or a group of small ones) computed at once by the merge threads: two keep the writer busy (see
# resumerge.merge.engine.executor._Pipeline).
CONCURRENCY = 2
# Groups in flight per worker (computing, or finished and waiting for an older one to reach the writer): a finished
# group holds its result and its reservation until it is written, so this bounds what waits behind a long unit
# (the memory they hold is the governor's to admit, as every unit's). At 2, a GGUF release of SmolLM2-135M in 7 types
# left a core idle behind each layer's down_proj (7 encodings of 1536-column rows: 1.0 CPU s, where the layer's
# other 6 groups take 0.7 together): the other worker finished the 2 groups the line let it take, then waited. A
# replay of that run's 212 groups (their measured CPU, bench/release_threads.py --units) on 2 workers: 31.3 s at
# 2 per worker, 28.3 at 3, 26.3 at 4 (their CPU over 2: 26.2). The merge's governor admits as many units in flight
# (resumerge.merge.engine.devices.make_governor): its reservations are the line's, held until written.
HELD_PER_WORKER = 4


class Group(Protocol):
    """What the line needs of a group: whether it only collects its sibling's result (it then computes nothing and
    takes no worker's turn)."""

    @property
    def sibling(self) -> bool: ...


G = TypeVar("G", bound=Group)
R = TypeVar("R")


class InFlight(Generic[G, R]):
    """Groups started on a pool, oldest first, each with its future and its memory reservation (None without a
    governor). ``put(group, result, reservation)`` hands one to the writer in order: it returns False when the run
    stopped (it then releases the reservation itself). Used by one thread."""

    def __init__(self, workers: int, put: Callable[[G, R, Reservation | None], bool]) -> None:
        self.workers, self._put = workers, put
        self._line: deque[tuple[G, Future[R], Reservation | None]] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def add(self, group: G, future: Future[R], reservation: Reservation | None) -> None:
        """Record a group just started (the newest)."""
        self._line.append((group, future, reservation))

    def working(self) -> int:
        """Groups still computing (not those collecting a sibling's result, nor finished ones)."""
        return sum(1 for group, future, _ in self._line if not group.sibling and not future.done())

    def make_room(self, sibling: bool, limit: int) -> bool:
        """Wait until the next group may start: fewer than ``limit`` groups compute (a ``sibling`` group needs no
        worker) and fewer than :data:`HELD_PER_WORKER` times the workers' groups are in flight. Finished groups at
        the head of the line go to the writer as they come; False when the run stopped."""
        while True:
            while self._line and self._line[0][1].done():
                if not self.hand_over_oldest():
                    return False
            working = self.working()
            if sibling or (working < limit and len(self._line) < HELD_PER_WORKER * self.workers):
                return True
            if working < limit:  # finished groups wait behind the oldest, which still computes: it goes first
                if not self.hand_over_oldest():
                    return False
                continue
            wait([future for group, future, _ in self._line if not group.sibling and not future.done()],
                 return_when=FIRST_COMPLETED)

    def hand_over_oldest(self) -> bool:
        """Wait for the oldest group's result and hand it to the writer; False when the run stopped. A group whose
        computation raised gives its reservation back and the error goes on."""
        group, future, reservation = self._line.popleft()
        with released_on_error(reservation):  # the group's error goes on as it came; its memory is free
            result = future.result()
        return self._put(group, result, reservation)

    def flush(self) -> bool:
        """Hand every group to the writer, oldest first; False when the run stopped."""
        while self._line:
            if not self.hand_over_oldest():
                return False
        return True

    def close(self) -> None:
        """Cancel what has not started and release every reservation still held here as its group ends (the run
        ends): at once for a group cancelled or finished, when its computation ends for one still computing."""
        for _, future, reservation in self._line:
            future.cancel()
            if reservation is not None:
                # A worker may still compute its group after the run ends: the memory stays in use until it is
                # done, and the governor, shared beyond this line (hub read-ahead grants), must not hand it out.
                _release_when_done(future, reservation)
        self._line.clear()


def _release_when_done(future: Future[R], reservation: Reservation) -> None:
    future.add_done_callback(lambda _: reservation.release())
