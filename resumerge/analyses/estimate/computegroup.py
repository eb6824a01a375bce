"""The compute time of one group of a plan's pending tensors, as :mod:`resumerge.analyses.estimate.compute` measures it,
and ``plan``'s notes of it (:func:`compute_lines`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from resumerge.machine.memory import format_size


@dataclass(frozen=True)
class ComputeGroup:
    """The compute time of one group of pending tensors (same method, compute dtype and non-numeric parameters),
    measured on ``sample_elements`` outputs made from ``sample_bytes`` of the plan's own inputs (synthetic inputs
    of the same shapes when ``synthetic``); ``seconds_per_element`` is None when not measured (``note`` says
    why; for a group timed by whole calls it says what bounds the method's time, its WholeCost.bound).
    ``measure_seconds`` is what measuring took."""

    method: str
    dtype: str
    device: str
    tensors: int
    elements: int
    sample_elements: int
    sample_bytes: int
    seconds_per_element: float | None
    threads: int
    synthetic: bool = False
    note: str = ""
    measure_seconds: float = 0.0
    seconds_per_call: float = 0.0  # the fixed part of each tensor's compute (thread wake-ups, kernel launches)
    # Timed by whole calls on synthetic inputs of the real shapes, priced per tensor (a decomposition, whose cost
    # does not follow its result's elements; see resumerge.merge.methods.spec.WholeCost).
    whole: bool = False
    # Tensors the run computes side by side, each on ``threads`` threads (its workers, where they fill torch's
    # threads on the CPU): the rates above are the group's wall per element and per tensor, one tensor's timed
    # cost over this.
    at_once: int = 1

    @property
    def seconds(self) -> float | None:
        """Estimated compute seconds of the group's pending elements (None when not measured)."""
        if self.seconds_per_element is None:
            return None
        return self.seconds_per_element * self.elements + self.seconds_per_call * self.tensors

    def line(self) -> str:
        """One line for ``plan``: what was measured on what, and what it scales to."""
        where = self._where()
        rate = self.seconds_per_element
        if rate is None:
            return f"compute: {self.method} ({where}) {self.note}"
        if self.whole:
            bound = f" {self.note}," if self.note else ""
            inputs = "one call with synthetic inputs" if self.synthetic else "its real inputs"
            return (f"compute: {self.method} ({where}){bound} timed on {inputs} of "
                    f"{self.sample_elements / 1e6:.2f} M elements: {_seconds_text(self.seconds_per_call)} per tensor, "
                    f"so about {_seconds_text(self.seconds_per_call * self.tensors)} for {self.tensors} tensor(s)")
        sample = (f"{self.sample_elements / 1e6:.2f} M synthetic elements (inputs not on disk yet)" if self.synthetic
                  else f"{self.sample_elements / 1e6:.2f} M elements from {format_size(self.sample_bytes)} of the "
                  "inputs")
        per_call = f" + {self.seconds_per_call * 1e3:.1f} ms per tensor" if self.seconds_per_call else ""
        total = rate * self.elements + self.seconds_per_call * self.tensors
        return (f"compute: {self.method} ({where}) measured on {sample}: {rate * 1e9:.1f} ns/element{per_call}, "
                f"so about {_seconds_text(total)} for {self.elements / 1e6:.1f} M elements in {self.tensors} "
                "tensor(s)")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["seconds"] = None if self.seconds is None else round(self.seconds, 2)
        doc["measure_seconds"] = round(self.measure_seconds, 3)
        return doc

    def _where(self) -> str:
        where = f"{self.dtype} on {self.device}, {self.threads} thread(s)"
        return where + (f" each, {self.at_once} tensors at once" if self.at_once > 1 else "")


def compute_lines(groups: list[ComputeGroup]) -> list[str]:
    """The lines ``plan`` prints for ``groups``: one per group, but one per method for the groups timed by whole
    calls (a decomposition is timed once per shape class: a model's six classes said the same six times)."""
    lines: list[str] = []
    wholes: dict[tuple[Any, ...], list[ComputeGroup]] = {}
    for group in groups:
        if group.whole and group.seconds_per_element is not None:
            key = (group.method, group._where(), group.note)
            if key not in wholes:
                lines.append("")  # its place, filled below
                wholes[key] = []
            wholes[key].append(group)
        else:
            lines.append(group.line())
    merged = iter([alike[0].line() if len(alike) == 1 else _whole_line(alike) for alike in wholes.values()])
    return [line or next(merged) for line in lines]


def _whole_line(alike: list[ComputeGroup]) -> str:
    """One line for the whole-call groups ``alike`` (one method, one place, shape classes apart)."""
    first = alike[0]
    bound = f" {first.note}," if first.note else ""
    per_tensor = sorted(g.seconds_per_call for g in alike)
    sizes = sorted(g.sample_elements for g in alike)
    tensors = sum(g.tensors for g in alike)
    total = sum(g.seconds_per_call * g.tensors for g in alike)
    low, high = _seconds_text(per_tensor[0]), _seconds_text(per_tensor[-1])
    inputs = "synthetic inputs" if first.synthetic else "real inputs"
    return (f"compute: {first.method} ({first._where()}){bound} timed on one call per shape ({len(alike)} shapes, "
            f"{inputs} of {sizes[0] / 1e6:.2f} to {sizes[-1] / 1e6:.2f} M elements): "
            f"{low if low == high else f'{low} to {high}'} per tensor, so about {_seconds_text(total)} for "
            f"{tensors} tensor(s)")


def _seconds_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
