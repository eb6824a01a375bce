"""How many notebook sessions of a given length a merge takes (``plan --session 12h``), and how many commits an
``hf://`` OUT gets under the default pacing: what someone merging a terabyte from a 12-hour runtime asks first.

A session pays the start-up again (imports, planning, reading the ledger) before it works on; the merge's wall
comes from the network estimate when the merge uses the network (at ``--bandwidth`` or the measured rate), else
from the local time estimate. Commits follow :meth:`~resumerge.config.settings.Batching.pipelined`: each file its
own commit while there are fewer than the pacing allows, else the first ``burst`` of an hour and then one per
``spacing`` seconds, each taking every file uploaded meanwhile, plus the run's last.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

from resumerge.config.settings import Batching
from resumerge.errors import UsageError
from resumerge.machine.memory.sizes import format_duration

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(h|hours?|m|min|minutes?|s|sec|seconds?)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = MappingProxyType({"h": 3600.0, "m": 60.0, "s": 1.0})


def parse_duration(text: str, *, option: str = "--session") -> float:
    """Seconds of ``text``: a number with ``h``, ``m``/``min`` or ``s`` (hours when bare: ``12`` is ``12h``).
    Raises :class:`~resumerge.errors.UsageError` (exit 2) for anything else or a length of zero."""
    found = _DURATION.match(text)
    if found is None or float(found.group(1)) <= 0:
        raise UsageError(f"{option}: invalid length {text!r}", hint="give a length like 12h, 90m or 3600s")
    unit = (found.group(2) or "h")[0].lower()
    return float(found.group(1)) * _UNIT_SECONDS[unit]


@dataclass(frozen=True)
class SessionPlan:
    """The merge's estimated wall (``run_seconds``, None when unknown, from ``source``) cut into sessions of
    ``length`` seconds, each of which first spends ``startup_seconds``."""

    length: float
    run_seconds: float | None
    startup_seconds: float
    source: str

    @property
    def sessions(self) -> int | None:
        """Sessions the merge needs (None when its wall is unknown, or a session is too short to do any work)."""
        if self.run_seconds is None or self.length <= self.startup_seconds:
            return None
        work = max(0.0, self.run_seconds - self.startup_seconds)
        return max(1, math.ceil(work / (self.length - self.startup_seconds)))

    def line(self) -> str:
        """One line for ``plan``."""
        length = format_duration(self.length)
        if self.run_seconds is None:
            return f"sessions of {length}: unknown ({self.source} has no wall time; pass --bandwidth DOWN/UP)"
        if self.sessions is None:
            return f"sessions of {length}: too short for the start-up ({format_duration(self.startup_seconds)})"
        run, startup = format_duration(self.run_seconds), format_duration(self.startup_seconds)
        return (f"{self.sessions} session(s) of {length} for about {run} ({self.source}; each session starts with "
                f"{startup} of start-up, then resumes where the last stopped)")

    def to_json(self) -> dict[str, object]:
        return {"length_seconds": self.length, "run_seconds": None if self.run_seconds is None else
                round(self.run_seconds, 1), "startup_seconds": round(self.startup_seconds, 1),
                "source": self.source, "sessions": self.sessions}


def hub_commits(files: int, seconds: float | None, batching: Batching | None = None) -> int:
    """Commits a run that uploads ``files`` files over ``seconds`` (None: unknown, as fast as they come) makes into
    its repo under ``batching`` (default :meth:`~resumerge.config.settings.Batching.pipelined`)."""
    pacing = batching or Batching.pipelined()
    if files <= 0:
        return 0
    batches = math.ceil(files / max(1, pacing.every))
    if seconds is None or pacing.spacing <= 0:
        return batches
    # The burst at once, then one commit per spacing (the burst never refills: a minute's pace is 60 an hour),
    # and the last commit, which waits for no spacing.
    return min(batches, pacing.burst + math.ceil(seconds / pacing.spacing) + 1)
