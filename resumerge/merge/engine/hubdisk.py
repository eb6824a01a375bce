"""The local disk an ``hf://`` OUT needs while its files wait for their commits (``plan``'s ``hf://`` line), and a
free account's private storage, which the hub enforces only at the commit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from resumerge.machine.memory.sizes import format_size

if TYPE_CHECKING:
    from resumerge.merge.plan.merge_plan import Plan


# What a free Hugging Face account may keep in private repos, all of them together (since December 2024).
FREE_PRIVATE_STORAGE = 100 * 10**9


@dataclass(frozen=True)
class HubDiskNeed:
    """Local disk an ``hf://`` OUT needs: staged files wait there until their commit, so at most ``staging``
    bytes (``--max-disk`` when given, else in the worst case the whole output, when uploads fall behind)."""

    output_bytes: int
    largest_file: int
    max_disk: int | None

    @property
    def staging(self) -> int:
        return self.max_disk if self.max_disk is not None else self.output_bytes

    @property
    def problem(self) -> str | None:
        """Why ``max_disk`` cannot work, or None."""
        if self.max_disk is not None and self.max_disk < self.largest_file:
            return (f"--max-disk {format_size(self.max_disk)} is below the largest output shard "
                    f"({format_size(self.largest_file)})")
        return None

    def line(self) -> str:
        bound = f"--max-disk {format_size(self.max_disk)}" if self.max_disk is not None else "no --max-disk"
        line = (f"with hf:// OUT: local disk for staged output at most {format_size(self.staging)} ({bound}; "
                f"the smallest that works is {format_size(self.largest_file)}, one shard); the "
                f"{format_size(self.output_bytes)} output goes to the repo")
        if self.output_bytes > FREE_PRIVATE_STORAGE:
            # The hub refuses it at the commit, after the upload (403 "Private repository storage limit reached").
            line += (f"; private (the default) it exceeds a free account's {format_size(FREE_PRIVATE_STORAGE)} of "
                     "private storage: pass --public, or check the account's storage")
        return line

    def to_json(self) -> dict[str, int | None]:
        return {"output_bytes": self.output_bytes, "largest_file": self.largest_file, "max_disk": self.max_disk,
                "staging_bytes": self.staging}


def hub_disk_need(plan: Plan, max_disk: int | None) -> HubDiskNeed:
    """The local disk merging ``plan`` into a hub repo needs, under ``max_disk``."""
    together: dict[str, int] = {}  # files one computation writes are staged together (a GGUF release's)
    for shard in plan.shards:
        lead = plan.container.lead(shard.name)
        together[lead] = together.get(lead, 0) + shard.file_size
    return HubDiskNeed(sum(together.values()), max(together.values(), default=0), max_disk)
