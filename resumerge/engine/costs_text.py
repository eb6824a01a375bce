"""An estimate's text, as ``resumerge plan`` prints it: the plan's headline, one line per fact (output, downloads,
memory, disk, time, …), the notes, and the verdict with its reasons. Made here once, for the CLI to draw with its
styles (:func:`resumerge.cli.render.show_plan`) and for an :class:`~resumerge.engine.costs.Estimate` to show as
its ``repr`` — a notebook cell ending in ``api.estimate(...)`` printed the whole plan, every tensor (257 KB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from resumerge.memory.sizes import format_duration, format_size
from resumerge.plan.summary import field_line, headline, plan_fields

if TYPE_CHECKING:
    from resumerge.engine.costs import Estimate, MemoryEstimate

# What a line is, for the CLI's styles: the headline, a labelled fact, a labelled note, the verdict, a reason.
HEAD, FIELD, NOTE, FITS, UNFIT, REASON = "head", "field", "note", "fits", "unfit", "reason"


@dataclass(frozen=True)
class Line:
    """One line of the estimate's text: ``label`` (empty for the headline, the verdict and its reasons), ``text``
    and its ``kind``."""

    kind: str
    text: str
    label: str = ""

    def plain(self) -> str:
        """The line as plain text."""
        if self.kind == REASON:
            return f"  - {self.text}"
        return field_line(self.label, self.text) if self.label else self.text


def estimate_lines(estimate: Estimate) -> list[Line]:
    """Every line of ``plan``'s text for ``estimate``, in order."""
    plan, output, memory = estimate.plan, estimate.output, estimate.memory
    lines = [Line(HEAD, headline(plan))]

    def fact(label: str, text: str) -> None:
        lines.append(Line(FIELD, text, label))

    committed = f"; {format_size(output.committed_bytes)} already committed" if output.committed_bytes else ""
    fact("output", f"{format_size(output.total_bytes)} ({len(plan.shards)} shard(s), the largest "
         f"{format_size(output.largest_shard_bytes)}){committed}" + (f" in {output.dir}" if output.dir else ""))
    for label, text in plan_fields(plan):
        fact(label, text)
    if estimate.shard_choice:
        fact("shards", f"up to {format_size(plan.options.out_shard_size)} each ({estimate.shard_choice})")
    if output.staging_dir:
        fact("staging", f"{format_size(output.staging_bytes)} at a time in {output.staging_dir}")
    if estimate.downloads:
        cached = sum(d.cached_bytes + d.verify_bytes for d in estimate.downloads.values())
        fact("download", f"{format_size(estimate.download_bytes)} from the hub ({format_size(cached)} already cached)")
    else:
        fact("download", "nothing (local models)")
    from resumerge.plan.fetching import fetch_summary  # torch (via .bin inputs): imported when an estimate is shown

    summary = fetch_summary(estimate.fetch)
    if summary:
        fact("fetch", summary)
    for c in estimate.fetch:
        fact("input", f"{c.model}/{c.file}: {c.how} {format_size(c.fetch_bytes)} of {format_size(c.size)} "
             f"({c.reason})")
    fact("memory", memory_line(memory))
    if estimate.time.prepass_seconds or memory.prepass_bytes:
        when = "beside the merge" if memory.prepass_beside else "first"
        fact("pass", f"the prompt forward pass {when}, in a process of its own: about "
             f"{format_duration(estimate.time.prepass_seconds)}, {format_size(memory.prepass_bytes)} in that process")
    for disk in estimate.disks:
        mark = "" if disk.fits else " -- too small"
        fact("disk", f"{' + '.join(disk.roles)}: needs {format_size(disk.needed_bytes)}, "
             f"{format_size(disk.free_bytes)} free on {disk.path}{mark}")
    if estimate.hf_output is not None:
        fact("hf://", estimate.hf_output.line())
    fact("time", time_text(estimate))
    if estimate.network is not None:
        fact("network", estimate.network.line())
    if estimate.hub_commits is not None:
        fact("commits", f"about {estimate.hub_commits} into the repo, one per shard as it is uploaded, paced under "
             "the hub's 128 an hour")
    if estimate.session is not None:
        fact("sessions", estimate.session.line())
    lines += [Line(NOTE, note, "note") for note in (*plan.notes, *estimate.notes, *estimate.time.notes)]
    if estimate.fits:
        return [*lines, Line(FITS, "fits")]
    return [*lines, Line(UNFIT, "will not fit"), *(Line(REASON, reason) for reason in estimate.reasons)]


def estimate_text(estimate: Estimate) -> str:
    """``plan``'s text for ``estimate``, plain."""
    return "\n".join(line.plain() for line in estimate_lines(estimate))


def memory_line(memory: MemoryEstimate) -> str:
    """``plan``'s memory line, in words that agree with its verdict (which compares the peak *as the budget counts
    it* with the budget): a peak above the budget is never said to be "under" it — the part the budget counts is
    named, within the budget or over it."""
    peak = (f"peak about {format_size(memory.peak_bytes)} ({format_size(memory.baseline_bytes)} process + "
            f"{format_size(memory.working_set_bytes)} working set)")
    budget = f"the {format_size(memory.budget)} budget ({memory.budget_source})"
    if memory.peak_bytes <= memory.budget:
        return f"{peak} under a {format_size(memory.budget)} budget ({memory.budget_source})"
    counted = format_size(memory.counted_peak_bytes)
    if memory.counted_peak_bytes <= memory.budget:
        return f"{peak}, of which {counted} counts against {budget}; mapped library files do not"
    as_counted = f", {counted} as the budget counts it" if memory.counted_peak_bytes != memory.peak_bytes else ""
    return f"{peak}{as_counted}: over {budget}"


def time_text(estimate: Estimate) -> str:
    """``plan``'s time line: the total, what bounds it, and the disk's rates."""
    t = estimate.time
    compute = f"{format_duration(t.compute_seconds)} of compute" if t.compute else ""
    if t.seconds is None:
        return "unknown (disk speed not measured)" + (f"; {compute}" if compute else "")
    rates = []
    if t.read_bytes_per_s:
        rates.append(f"read {format_size(t.read_bytes + t.verify_bytes + t.rehash_bytes)} at "
                     f"{format_size(int(t.read_bytes_per_s))}/s")
    if t.write_bytes_per_s:
        rates.append(f"write {format_size(t.write_bytes)} at {format_size(int(t.write_bytes_per_s))}/s")
    if not compute:
        return f"about {format_duration(t.seconds)} of disk work: {', '.join(rates)}"
    # With cores to spare compute and disk work overlap, so the total is not their sum: say both, and what bounds
    # it; on a machine whose cores the engine's threads fill, they add up (see TimeEstimate).
    disk = t.disk_seconds or 0.0
    bound = "compute-bound" if t.compute_seconds > disk else "disk-bound"
    joined = "plus (they share this machine's cores)" if t.shared_cores else "overlapped with"
    return (f"about {format_duration(t.seconds)} ({bound}): {compute} {joined} {format_duration(disk)} of disk work "
            f"({', '.join(rates)})")
