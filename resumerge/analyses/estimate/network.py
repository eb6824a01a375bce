"""The network side of ``resumerge plan``: bytes to download and to upload, at what link rate, and which of
download, upload and the local merge bounds a pipelined run.

A merge that reads hub inputs or writes an ``hf://`` OUT downloads, merges and uploads at once: input bytes are
fetched in the order the plan reads them, a shard is merged once its inputs are there, and a finished shard is
uploaded while the next are merged. Its wall time is then set by the slowest of the three, plus what cannot
overlap: start-up (imports, planning) before the first byte moves, the first shard fetched and merged before any
upload starts, and the last shard's upload only after its last tensor. The local side is the merge's own work plus
the CPU the transfers take on this machine's cores (receiving, writing the HF cache, hashing, reading back,
sending; :mod:`resumerge.analyses.estimate.cpuprobe`), which on a machine of few cores is what bounds a fast link.
:class:`NetworkEstimate` holds the figures and that arithmetic; the link's rates come from ``--bandwidth
DOWN[/UP]`` or, for the download only, a measurement (:func:`measure_download`: two range reads of a hub input, a
small one for the latency and a larger one for the rate). An upload rate is never measured (``plan`` uploads
nothing): without ``--bandwidth`` the upload time is unknown and ``plan`` says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ResumergeError, UsageError
from resumerge.machine.memory.sizes import format_duration, format_size, parse_size

GIVEN, MEASURED = "--bandwidth", "measured"
DOWNLOAD, UPLOAD, COMPUTE = "download", "upload", "compute"
PROBE_SMALL = 64 * 1024  # the latency read
PROBE_LARGE = 8 * 1024 * 1024  # the rate read: a fraction of a second on any link worth merging over


@dataclass(frozen=True)
class Bandwidth:
    """Link rates in bytes per second (None: unknown) and where they come from (:data:`GIVEN`, :data:`MEASURED`)."""

    down: float | None
    up: float | None
    source: str


def parse_bandwidth(text: str) -> Bandwidth:
    """``DOWN[/UP]`` in bytes per second with the size units of ``--max-memory`` (``150MB/75MB``; a trailing
    ``/s`` on either is accepted); UP defaults to DOWN. Raises :class:`UsageError` (exit 2) for anything else."""
    parts = [p.strip() for p in text.replace("/s/", "/").removesuffix("/s").split("/")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise UsageError(f"--bandwidth: invalid value {text!r}", hint="give DOWN[/UP] per second, e.g. 150MB/75MB")
    rates = [parse_size(p, option="--bandwidth") for p in parts]
    if min(rates) <= 0:
        raise UsageError("--bandwidth must be positive", hint="give DOWN[/UP] per second, e.g. 150MB/75MB")
    return Bandwidth(float(rates[0]), float(rates[-1]), GIVEN)


@dataclass(frozen=True)
class NetworkEstimate:
    """Bytes each way, the link, and the local merge time, for a run that overlaps all three.

    ``local_seconds`` is the merge without the network after start-up (disk work and compute, as the time estimate has
    it; None when unknown); ``startup_seconds`` what comes before the first byte moves (imports, planning);
    ``import_seconds`` torch's import, after the first bytes move and before the first shard is merged
    (:mod:`resumerge.machine.torch_import`); ``transfer_cpu_seconds`` the CPU the transfers take here, shared with the
    merge by ``cores``; ``first_share`` the fraction of the output in the first shard (its inputs are fetched and merged
    before the first upload); ``tail_bytes`` the last shard's size (uploaded after the merge).
    """

    down_bytes: int
    up_bytes: int
    link: Bandwidth
    local_seconds: float | None
    first_share: float = 0.0
    tail_bytes: int = 0
    note: str = ""
    startup_seconds: float = 0.0
    transfer_cpu_seconds: float = 0.0
    cores: int = 1
    import_seconds: float = 0.0

    @property
    def work_seconds(self) -> float:
        """The local side after start-up: the merge, plus the transfers' CPU spread over the cores."""
        return (self.local_seconds or 0.0) + self.transfer_cpu_seconds / max(1, self.cores)

    @property
    def down_seconds(self) -> float | None:
        return _seconds(self.down_bytes, self.link.down)

    @property
    def up_seconds(self) -> float | None:
        return _seconds(self.up_bytes, self.link.up)

    @property
    def seconds(self) -> float | None:
        """Expected wall time of the pipelined run (None when a rate it needs is unknown).

        Start-up comes first. Then input and merge overlap: ``max(download, import + work)`` (the merge starts once
        torch is imported). The upload trails: it starts once the first shard is done, not before the import, and
        ends after the last shard's upload, which starts when the merge ends, so the run lasts start-up plus the
        longer of ``max(download, import + work) + last shard's upload`` and ``max(first shard's share of that,
        import) + the whole upload``."""
        down, up = self.down_seconds, self.up_seconds
        if down is None or up is None:
            return None
        ahead = self._ahead(down)
        if not self.up_bytes:
            return self.startup_seconds + ahead
        tail = _seconds(self.tail_bytes, self.link.up) or 0.0
        return self.startup_seconds + max(ahead + tail, self._first_upload(ahead) + up)

    def _ahead(self, down: float) -> float:
        return max(down, self.import_seconds + self.work_seconds)

    def _first_upload(self, ahead: float) -> float:
        return max(self.first_share * ahead, self.import_seconds)

    @property
    def bound(self) -> str | None:
        """What sets the pace: :data:`DOWNLOAD`, :data:`UPLOAD` or :data:`COMPUTE` (the merge and the transfers'
        CPU; None when unknown)."""
        down, up = self.down_seconds, self.up_seconds
        if down is None or up is None:
            return None
        ahead = self._ahead(down)
        tail = _seconds(self.tail_bytes, self.link.up) or 0.0
        if self.up_bytes and self._first_upload(ahead) + up > ahead + tail:
            return UPLOAD
        return DOWNLOAD if down >= self.import_seconds + self.work_seconds else COMPUTE

    def line(self) -> str:
        """One line for ``plan``."""
        parts = [_direction("download", self.down_bytes, self.link.down, self.link.source),
                 _direction("upload", self.up_bytes, self.link.up, self.link.source)]
        text = "; ".join(p for p in parts if p)
        local = f"local merge about {_duration(self.local_seconds)}" if self.local_seconds is not None else ""
        if self.transfer_cpu_seconds:
            local += (f"{', ' if local else ''}the transfers' CPU about {_duration(self.transfer_cpu_seconds)} on "
                      f"{self.cores} core(s)")
        if self.startup_seconds:
            local += f"{', ' if local else ''}start-up {_duration(self.startup_seconds)}"
        if self.import_seconds:
            local += f"{', ' if local else ''}torch's import {_duration(self.import_seconds)} beside the first bytes"
        seconds = self.seconds
        if seconds is None:
            return f"{text}; {local + '; ' if local else ''}unknown link: pass --bandwidth DOWN/UP (e.g. 150MB/75MB)"
        return (f"about {_duration(seconds)} pipelined, {self.bound}-bound: {text}"
                + (f"; {local}" if local else ""))

    def to_json(self) -> dict[str, Any]:
        def rounded(value: float | None, digits: int = 1) -> float | None:
            return None if value is None else round(value, digits)

        return {"down_bytes": self.down_bytes, "up_bytes": self.up_bytes,
                "down_bytes_per_s": rounded(self.link.down, 0), "up_bytes_per_s": rounded(self.link.up, 0),
                "source": self.link.source, "down_seconds": rounded(self.down_seconds),
                "up_seconds": rounded(self.up_seconds), "local_seconds": rounded(self.local_seconds),
                "startup_seconds": rounded(self.startup_seconds), "import_seconds": rounded(self.import_seconds),
                "transfer_cpu_seconds": rounded(self.transfer_cpu_seconds), "cores": self.cores,
                "seconds": rounded(self.seconds), "bound": self.bound, "note": self.note}


def _seconds(nbytes: int, rate: float | None) -> float | None:
    if not nbytes:
        return 0.0
    return None if rate is None else nbytes / rate


def _direction(label: str, nbytes: int, rate: float | None, source: str) -> str:
    if not nbytes:
        return ""
    if rate is None:
        return f"{label} {format_size(nbytes)} at an unknown rate"
    return (f"{label} {format_size(nbytes)} at {format_size(int(rate))}/s ({source}) = "
            f"{_duration(nbytes / rate)}")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds:.1f} s" if seconds < 10 else format_duration(seconds)  # a tenth where a second is much


def measure_download(read: Callable[[int, int], object], size: int, *,
                     clock: Callable[[], float] = time.perf_counter) -> float | None:
    """The download rate in bytes per second from two range reads of one hub file of ``size`` bytes through
    ``read(start, end)``: a small one (the latency) and a larger one; their difference is the rate. None when the
    file is too small to tell, or the reads failed."""
    large = min(PROBE_LARGE, size)
    if large < 4 * PROBE_SMALL:
        return None
    try:
        started = clock()
        read(0, PROBE_SMALL)
        small_seconds = clock() - started
        started = clock()
        read(size - large, size)  # another part of the file than the header the plan read
        large_seconds = clock() - started
    except (ResumergeError, OSError):  # a measurement that fails only leaves the rate unknown
        return None
    spent = large_seconds - small_seconds
    return (large - PROBE_SMALL) / spent if spent > 0 else None
