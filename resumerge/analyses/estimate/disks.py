"""The disks a merge needs, grouped by filesystem (paths on one share its free space): OUT, the state dir's ledger,
a pass's files, the staging folder, the hub cache; where the estimate measures OUT's disk; what a short disk says."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from resumerge.analyses.estimate.costs import DiskNeed, ModelDownload, OutputSize
from resumerge.config.locations import StateDir
from resumerge.inputs.catalog import Inputs
from resumerge.machine.diskprobe import DiskFree, device_of, nearest_existing
from resumerge.machine.memory import format_size
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.sidefiles import aux_files

# A ledger row per tensor and per file, SQLite pages, and a WAL of the same size again: a generous bound.
_LEDGER_FIXED = 256 * 1024
_LEDGER_PER_ROW = 600


def disk_needs(plan: Plan, output: OutputSize, downloads: Mapping[str, ModelDownload], inputs: Inputs,
               out: Path | None, state: StateDir, disk_free: DiskFree, pass_bytes: int = 0) -> list[DiskNeed]:
    """Group the needs by filesystem (paths on one filesystem share its free space); ``pass_bytes``: what a pass
    before the merge holds in the state dir at most."""
    needs: list[tuple[str, Path, int]] = []
    if out is not None:
        needs.append(("output", out, output.needed_bytes))
        needs.append(("state", state.run_dir(out), _ledger_bytes(plan)))
    else:
        needs.append(("state", state.root, _ledger_bytes(plan)))
    if pass_bytes:
        needs.append(("state", state.root, pass_bytes))
    if output.staging_dir is not None:
        needs.append(("staging", Path(output.staging_dir), output.staging_bytes))
    for key, d in downloads.items():
        if d.bytes:
            needs.append(("hub cache", Path(inputs.hub[key].settings.cache_dir), d.bytes))
    groups: dict[int, tuple[Path, list[str], int]] = {}
    for role, path, nbytes in needs:
        dev = device_of(path)
        where, roles, total = groups.get(dev, (nearest_existing(path), [], 0))
        groups[dev] = (where, roles if role in roles else [*roles, role], total + nbytes)
    return [DiskNeed(str(where), tuple(roles), disk_free(where), total) for where, roles, total in groups.values()]


def _ledger_bytes(plan: Plan) -> int:
    rows = len(plan.tensors) + len(plan.shards) + len(aux_files(plan))
    return _LEDGER_FIXED + _LEDGER_PER_ROW * rows


def probe_dir(out: Path) -> Path:
    """Where to measure OUT's disk: beside OUT when that is the same filesystem, so OUT itself stays untouched
    (a probe file left in an empty OUT by a kill would make ``run`` refuse it)."""
    parent = nearest_existing(out.parent)
    if not out.exists() or device_of(parent) == device_of(out):
        return parent
    return out


def disk_reason(disk: DiskNeed, output: OutputSize) -> str:
    """The line ``plan`` refuses a ``disk`` too small by: what needs it, what is short, and the ways out."""
    fixes = []
    if "output" in disk.roles:
        fixes.append("choose an OUT on a disk with more room")
    if "staging" in disk.roles:
        fixes.append(f"a smaller --out-shard-size (the largest shard is {format_size(output.largest_shard_bytes)}) "
                     "or a --staging-dir on another disk")
    if "state" in disk.roles and "output" not in disk.roles:
        fixes.append("a --state-dir on another disk")
    if "hub cache" in disk.roles:
        fixes.append("point HF_HUB_CACHE (or --transformers-cache) at a larger disk")
    short = disk.needed_bytes - disk.free_bytes
    need = "needs" if len(disk.roles) == 1 else "need"
    return (f"disk: {' + '.join(disk.roles)} {need} {format_size(disk.needed_bytes)} on the disk of {disk.path}, "
            f"but only {format_size(disk.free_bytes)} is free: free {format_size(short)} there, or "
            + " or ".join(fixes))
