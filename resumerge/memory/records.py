"""What the governor reports: adaptations for the ledger, and a consistent state reading for ``status``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Adaptation", "GovernorStats"]


@dataclass(frozen=True)
class Adaptation:
    """One change the governor made.

    ``knob`` is ``"in_flight_limit"``, ``"write_buffer_bytes"`` or ``"admit_alone"`` (a unit admitted with
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


@dataclass(frozen=True)
class GovernorStats:
    """The governor's latest reading and knobs, taken under one lock (bytes unless named otherwise)."""

    pool: str
    budget: int
    rss: int
    available: int
    projected: int
    headroom: int
    used_fraction: float
    level: int
    in_flight: int
    reserved: int
    in_flight_limit: int
    write_buffer_bytes: int
    peak_rss: int
    adaptations: int
    sampler_error: str | None
