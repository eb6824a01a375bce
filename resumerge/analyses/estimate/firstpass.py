"""A pass the run's own process makes before the merge starts, as ``plan`` counts it: ``run --imatrix-texts``'
importance matrix pass over the merge never written (:func:`resumerge.api.importance.importance_cost` makes it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from resumerge.machine.memory import format_size
from resumerge.machine.memory.sizes import format_duration


@dataclass(frozen=True)
class FirstPass:
    """A pass the run's own process makes before the merge starts (``--imatrix-texts``: the importance matrix pass
    over the merge never written), as the estimate counts it: ``what`` it is; the input bytes it reads
    (``read_bytes``: each tensor it runs, merged as it is read) and ``merge_share``, the part of the merge's own
    compute those reads redo (their share of the merge's input bytes); the bytes it writes under the state dir
    (``write_bytes``: its journal, each layer's hidden states and the sums so far, then the matrix) and the most it
    holds there at once (``state_bytes``); what its process holds beyond the baseline at its peak
    (``held_bytes``, the figure its own guard judges) and the seconds of its forward over the texts
    (``forward_seconds``: ``tokens`` through every layer's matrices); ``baseline_bytes``: what the run's process
    holds as the pass starts (a fresh process with the pass's modules imported, a size target's with the kernels
    of every type it measures loaded too, and the run's plans), which its
    :attr:`smallest_budget` counts, as the run's refusal of a budget too small does; ``merge_baseline_bytes`` and
    ``merge_budget``: the merge that follows it in that process, its baseline (the pass's modules stay imported,
    and the GGUF encoders' compiled kernels load beside them) and the smallest budget it works under, which the run
    refuses a budget below before the pass starts (0: not counted)."""

    what: str
    tokens: int
    read_bytes: int
    merge_share: float
    write_bytes: int
    state_bytes: int
    held_bytes: int
    forward_seconds: float
    baseline_bytes: int = 0
    merge_baseline_bytes: int = 0
    merge_budget: int = 0

    @property
    def peak_bytes(self) -> int:
        """The run's process at the pass's peak."""
        return self.baseline_bytes + self.held_bytes

    @property
    def smallest_budget(self) -> int:
        """The smallest ``--max-memory`` the pass works under: the figure ``plan`` and the run's refusal name."""
        from resumerge.machine.memory import smallest_budget_for

        return smallest_budget_for(self.held_bytes, baseline_bytes=self.baseline_bytes)

    def seconds(self, read_bytes_per_s: float | None, write_bytes_per_s: float | None, merge_compute: float) -> float:
        """Its wall: its reads and writes at the disks' speeds (not counted where unknown), the merge's compute
        its reads redo (``merge_compute``: the merge's), and its forward; the pass runs them in turn."""
        reads = self.read_bytes / read_bytes_per_s if read_bytes_per_s else 0.0
        writes = self.write_bytes / write_bytes_per_s if write_bytes_per_s else 0.0
        return reads + writes + merge_compute * self.merge_share + self.forward_seconds

    def line(self, seconds: float) -> str:
        """``plan``'s line of the pass, which takes ``seconds``."""
        return (f"{self.what} first, in the run's process: about {format_duration(seconds)} ({self.tokens} tokens; "
                f"reads {format_size(self.read_bytes)} of inputs, writes {format_size(self.write_bytes)} in the "
                f"state dir, {format_size(self.state_bytes)} there at most), {format_size(self.held_bytes)} beyond "
                f"the process: peak about {format_size(self.peak_bytes)}, the smallest budget that works "
                f"{format_size(self.smallest_budget)}")

    def to_json(self, seconds: float) -> dict[str, Any]:
        """``plan --json``'s ``first_pass``."""
        return asdict(self) | {"seconds": round(seconds, 1), "peak_bytes": self.peak_bytes,
                               "smallest_budget": self.smallest_budget}
