"""The memory governor: admits units of work only while their estimates fit, and shrinks the batch early.

See :mod:`resumerge.machine.memory.accounting` for how usage and headroom are computed and
:mod:`resumerge.machine.memory.pressure` for the levels at which the knobs come down.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import NoReturn

from resumerge.errors import UsageError
from resumerge.machine.memory.accounting import Usage, next_baseline
from resumerge.machine.memory.budget import SAFETY_MARGIN, smallest_budget_for, working_room
from resumerge.machine.memory.pressure import PressurePolicy, PressureTracker
from resumerge.machine.memory.probe import MemoryProbe, SystemProbe
from resumerge.machine.memory.records import Adaptation, Reservation
from resumerge.machine.memory.sizes import format_size

__all__ = ["MemoryGovernor", "Reservation"]

_MAX_ADAPTATIONS = 4096
# After a reclaim that could not make room (the unit was admitted alone over the headroom anyway), admissions alone go
# on without reclaiming, and without another adaptation, for this long: at most one garbage collection and one record
# a second. One per unit was a run at a too-small budget taking 135 s instead of 4.4 s with 4,096 adaptations.
_FRUITLESS_PAUSE = 1.0
_WAIT = object()
_RECLAIM = object()


@dataclass(frozen=True)
class Pacing:
    """How a :class:`MemoryGovernor` paces its units, the same for every run (tests tune it): the sampler reads the
    probe every ``sample_interval`` seconds, ``max_in_flight`` is the in-flight limit at level 0,
    ``margin_fraction`` the part of the budget admission never hands out, and ``policy`` how pressure moves the
    knobs."""

    sample_interval: float = 0.05
    max_in_flight: int = 4
    margin_fraction: float = SAFETY_MARGIN
    policy: PressurePolicy = field(default_factory=PressurePolicy)


class MemoryGovernor:
    """Keeps one memory pool (host RAM, or one GPU) under ``budget_bytes``. All methods are thread-safe.

    Admission is first come, first served, so a large unit is not starved by small ones queued behind it. The
    unit at the head is admitted when fewer than :attr:`in_flight_limit` units are in flight and its estimate
    fits the headroom — or when nothing at all is in flight, since waiting could not help then; if it exceeds
    the headroom in that case, the probe reclaims once and the admission is recorded as ``admit_alone``.
    An estimate above the whole budget is refused at once.

    The sampler thread (:meth:`start`) reads the probe every ``pacing.sample_interval`` seconds, tracks the peak
    and moves the knobs. Waiting admissions poll the probe themselves, so admission stays correct without it.

    ``baseline`` is what the process is expected to hold apart from its units (0: unknown), which sets
    :attr:`work_budget`; ``pacing`` (:class:`Pacing`; None: its defaults) the in-flight limit at level 0, the
    margin and the pressure policy; ``pool`` names the pool in adaptations (``"host"``, ``"cuda:0"``);
    ``budget_option`` the command-line option in error hints; ``clock`` exists for tests. ``reuse_reading``
    (seconds, 0: never) lets admissions and :meth:`chunk_rows` use the last reading while it is younger than that
    instead of reading the probe again: a probe reads a few /proc and cgroup files (about 0.2 ms), more than a tiny
    tensor's whole merge, and the reservations already account for what was admitted since.

    A thread must not acquire while it holds a reservation of the same governor without a ``timeout``: the
    second admission may wait for the first to be released.
    """

    def __init__(
        self,
        budget_bytes: int,
        probe: MemoryProbe | None = None,
        *,
        pacing: Pacing | None = None,
        pool: str = "host",
        budget_option: str = "--max-memory",
        clock: Callable[[], float] = time.monotonic,
        reuse_reading: float = 0.0,
        baseline: int = 0,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        pacing = pacing if pacing is not None else Pacing()
        sample_interval, max_in_flight, margin_fraction = pacing.sample_interval, pacing.max_in_flight, \
            pacing.margin_fraction
        if max_in_flight < 1 or sample_interval <= 0 or not 0 <= margin_fraction < 1:
            raise ValueError("need max_in_flight >= 1, sample_interval > 0 and 0 <= margin_fraction < 1")
        self.budget = budget_bytes
        # What the budget leaves for units beside the process's own expected baseline: the engine sizes its units,
        # groups and buffers by it (resumerge.merge.engine.footprint); the budget alone when no baseline is given.
        self.work_budget = working_room(budget_bytes, baseline, margin_fraction) if baseline else budget_bytes
        self.probe: MemoryProbe = probe if probe is not None else SystemProbe()
        self.pool = pool
        self.budget_option = budget_option
        self._interval = sample_interval
        self._max_in_flight = max_in_flight
        self._margin = margin_fraction
        self._policy = pacing.policy
        self._clock = clock
        self._reuse = reuse_reading
        self._read_at = -float("inf")  # time.monotonic() of the last probe reading
        self._cond = threading.Condition(threading.Lock())
        self._tracker = PressureTracker(self._policy)
        self._knobs = self._policy.knobs_for(0, max_in_flight)
        self._rss = self._available = self._baseline = self._reserved = self._in_flight = self._peak = 0
        self._holding = 0  # reservations granted with ``held``: reserved bytes, not units in flight
        self._admitted = self._largest = 0
        self._fruitless_at = -float("inf")  # self._clock() when a unit was last admitted alone over the headroom
        self._queue: deque[object] = deque()
        self._adaptations: deque[Adaptation] = deque(maxlen=_MAX_ADAPTATIONS)
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.sample()

    # -- sampler -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background sampler (a daemon thread); a no-op when it is running."""
        with self._cond:
            if self._thread is not None:
                return
            self._stop = threading.Event()
            name = f"resumerge-memory-{self.pool}"
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name=name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the sampler and wait for it; a no-op when it is not running. :meth:`start` may follow."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join(timeout=max(1.0, 10 * self._interval))

    def __enter__(self) -> MemoryGovernor:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def sample(self) -> None:
        """Take one reading now: update peak and knobs, wake waiting admissions. The sampler's step."""
        rss, available = self.probe.rss(), self.probe.available()
        self._read_at = time.monotonic()
        with self._cond:
            worse = self._absorb(rss, available)
            self._cond.notify_all()
        if worse:
            # Entering the top levels: take back what glibc and reference cycles hold before squeezing more.
            self.probe.reclaim()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            # A vanished /proc or cgroup file must not end the sampling; waiting admissions read the probe
            # themselves, so they stay correct meanwhile.
            with contextlib.suppress(Exception):
                self.sample()

    # -- admission -----------------------------------------------------------------------------------------

    def acquire(self, estimate_bytes: int, *, timeout: float | None = None, what: str | None = None,
                make_room: Callable[[], object] | None = None, held: bool = False) -> Reservation:
        """Block until ``estimate_bytes`` may be used; return the :class:`Reservation` that holds them.

        ``what`` (a tensor name) goes into errors and adaptations. ``make_room`` gives back memory the caller holds
        beyond its reservations (idle buffers): called, before the probe reclaims, when the unit would be admitted
        alone over the headroom. ``held``: bytes a unit keeps while its own parts are admitted one after another
        (a stream's sampled masks across its row chunks): admitted like a unit, counted in the headroom, but not a
        unit in flight once granted, so its parts are not held back by the in-flight limit, nor kept waiting by it
        when one is alone over the headroom (counted in flight, a stream's every chunk waited at a limit of 1
        until the pressure level eased, a second per level). Raises
        :class:`~resumerge.errors.UsageError` at once when the estimate exceeds the whole budget (it could
        never fit; the hint gives the smallest budget that would), :class:`TimeoutError` when ``timeout``
        seconds pass first, and :class:`ValueError` for a negative estimate. Never waits while nothing is in
        flight.
        """
        if estimate_bytes < 0:
            raise ValueError(f"estimate_bytes must not be negative, got {estimate_bytes}")
        if estimate_bytes > self.budget:
            self._refuse(estimate_bytes, what)
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = object()
        reclaimed = False
        with self._cond:
            self._queue.append(ticket)
        try:
            while True:
                reading = self._fresh_reading()
                with self._cond:
                    if reading is not None:
                        self._absorb(*reading)
                    outcome = self._try_grant(ticket, estimate_bytes, what, reclaimed, held)
                    if isinstance(outcome, Reservation):
                        return outcome
                    if outcome is _WAIT:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise TimeoutError(
                                f"no room for {format_size(estimate_bytes)} of {self.pool} memory after "
                                f"{timeout} s ({self._in_flight} units in flight)"
                            )
                        self._cond.wait(self._interval if remaining is None else min(self._interval, remaining))
                        continue
                # Alone yet over the headroom: get freed memory back once, then look again.
                if make_room is not None:
                    make_room()
                self.probe.reclaim()
                self._read_at = -float("inf")  # what reclaim gave back is seen at once
                reclaimed = True
        except BaseException:
            with self._cond:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                self._cond.notify_all()
            raise

    def chunk_rows(self, row_bytes: int, total_rows: int) -> int:
        """Return how many rows of an elementwise tensor to process per chunk under the current headroom.

        ``row_bytes`` is one row's working set (every input row at its dtype, the method's temporaries, the
        output row). A chunk gets at most headroom / :attr:`in_flight_limit`; the result lies between 1 and
        ``total_rows`` (0 only when ``total_rows`` is 0). Admit each chunk with ``rows * row_bytes``.
        """
        if row_bytes <= 0 or total_rows < 0:
            raise ValueError("row_bytes must be positive and total_rows not negative")
        if total_rows == 0:
            return 0
        reading = self._fresh_reading()
        with self._cond:
            if reading is not None:
                self._absorb(*reading)
            room = max(0, self._usage().headroom) // self._knobs.in_flight_limit
        return max(1, min(total_rows, room // row_bytes))

    # -- readings ------------------------------------------------------------------------------------------

    @property
    def in_flight_limit(self) -> int:
        """How many units may be in flight now (1 to ``max_in_flight``)."""
        with self._cond:
            return self._knobs.in_flight_limit

    @property
    def peak_rss(self) -> int:
        """The highest ``probe.rss()`` reading seen (sampled; ``os_peak_rss()`` has the OS's exact peak)."""
        with self._cond:
            return self._peak

    @property
    def admitted(self) -> int:
        """How many reservations :meth:`acquire` has granted: each one an admission, whatever it held."""
        with self._cond:
            return self._admitted

    @property
    def largest_admitted(self) -> int:
        """The largest estimate of a reservation :meth:`acquire` has granted (0 before any)."""
        with self._cond:
            return self._largest

    @property
    def adaptations(self) -> tuple[Adaptation, ...]:
        """The most recent adaptations (up to 4096), oldest first."""
        with self._cond:
            return tuple(self._adaptations)

    def _fresh_reading(self) -> tuple[int, int] | None:
        """A new (rss, available) reading of the probe, or None when the last one is younger than
        ``reuse_reading`` (the state holds it already). Call without self._cond held: a probe may be slow."""
        now = time.monotonic()
        if now - self._read_at < self._reuse:
            return None
        reading = self.probe.rss(), self.probe.available()
        self._read_at = time.monotonic()
        return reading

    # -- internals (the ones below take self._cond held) ----------------------------------------------------

    def _usage(self) -> Usage:
        return Usage(self.budget, self._rss, self._available, self._baseline, self._reserved, self._margin)

    def _absorb(self, rss: int, available: int) -> bool:
        """Fold a reading into the state; return True when pressure just rose to level 2 or above."""
        self._rss, self._available = rss, available
        self._peak = max(self._peak, rss)
        self._baseline = next_baseline(self._baseline, rss, self._reserved, self._in_flight + self._holding)
        used = self._usage().used_fraction
        before = self._tracker.level
        level = self._tracker.update(used, self._clock())
        if level == before:
            return False
        old, self._knobs = self._knobs, self._policy.knobs_for(level, self._max_in_flight)
        reason = (
            f"{self.pool} memory at {used:.0%} of the {format_size(self.budget)} budget "
            f"(rss {format_size(rss)}, available {format_size(available)})"
        )
        if self._knobs.in_flight_limit != old.in_flight_limit:
            self._record("in_flight_limit", old.in_flight_limit, self._knobs.in_flight_limit, reason)
        return level > before and level >= 2

    def _try_grant(self, ticket: object, estimate: int, what: str | None, reclaimed: bool, held: bool) -> object:
        """Return a Reservation, ``_WAIT`` (not admissible now) or ``_RECLAIM`` (alone but over headroom)."""
        if self._queue[0] is not ticket:
            return _WAIT
        headroom = self._usage().headroom
        if self._in_flight == 0 and estimate > headroom:
            now = self._clock()
            recent = now - self._fruitless_at < _FRUITLESS_PAUSE
            if not reclaimed and not recent:
                return _RECLAIM
            if not recent:
                reason = (
                    f"admitted {what or 'a unit'} alone over the headroom: nothing else was in flight "
                    f"(rss {format_size(self._rss)}, available {format_size(self._available)})"
                )
                self._record("admit_alone", max(0, headroom), estimate, reason)
                self._fruitless_at = now
        elif self._in_flight >= self._knobs.in_flight_limit or estimate > headroom:
            return _WAIT
        self._queue.popleft()
        if held:
            self._holding += 1
        else:
            self._in_flight += 1
        self._admitted += 1
        self._largest = max(self._largest, estimate)
        self._reserved += estimate
        # The next in line may fit as well; let it look now rather than at its next poll.
        self._cond.notify_all()
        return Reservation(self._release_held if held else self._release, estimate, what)

    def _record(self, knob: str, old: int, new: int, reason: str) -> None:
        self._seq += 1
        self._adaptations.append(Adaptation(self._seq, self._clock(), self.pool, knob, old, new, reason))

    def _release(self, reservation: Reservation, held: bool = False) -> None:  # takes the lock itself
        with self._cond:
            if reservation.released:
                return
            reservation.released = True
            if held:
                self._holding -= 1
            else:
                self._in_flight -= 1
            self._reserved -= reservation.nbytes
            self._cond.notify_all()

    def _release_held(self, reservation: Reservation) -> None:
        self._release(reservation, held=True)

    def _refuse(self, estimate: int, what: str | None) -> NoReturn:
        # The budget counts the whole process: what it holds beside its units is needed as well.
        smallest = smallest_budget_for(estimate, baseline_bytes=self._baseline, margin_fraction=self._margin)
        raise UsageError(
            f"{what or 'one unit of work'} needs {format_size(estimate)} of {self.pool} memory, more than "
            f"the whole budget of {format_size(self.budget)}",
            hint=f"rerun with {self.budget_option} {format_size(smallest, compact=True)} or more",
            tensor=what,
        )
