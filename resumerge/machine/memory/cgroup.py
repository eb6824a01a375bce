"""Read this process's memory cgroup: the container limit psutil cannot see.

psutil reads ``/proc/meminfo``, which is not namespaced, so inside a container it reports the host's memory
(psutil issue #2100). The real ceiling is the cgroup's: ``memory.max`` (v2) or ``memory.limit_in_bytes``
(v1), possibly set on an ancestor group. Every function here is pure file parsing relative to ``root`` so
tests run on fixture trees; a missing or unreadable file means "unknown" (``None``), never an exception.

Hybrid hosts mount v1 controllers next to a v2 tree that has no memory controller; since a controller lives in
exactly one hierarchy, a ``N:memory:/path`` line in ``/proc/self/cgroup`` wins over the ``0::/path`` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CgroupMemory",
    "CgroupSnapshot",
    "inactive_file",
    "locate",
    "memory_limit",
    "memory_usage",
    "oom_kill_count",
    "parse_proc_cgroup",
    "read_snapshot",
    "working_set",
]

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX rounded to pages (9223372036854771712 on x86-64).
_V1_UNLIMITED = 2**60
_V2_DEFAULT_MOUNT = "/sys/fs/cgroup"
_V1_DEFAULT_MOUNT = "/sys/fs/cgroup/memory"


@dataclass(frozen=True)
class CgroupMemory:
    """Where this process's memory cgroup lives on disk.

    ``directory`` is the process's own group; ``mount`` is the top of the hierarchy visible to us, so limits
    are read from ``directory`` and each ancestor up to and including ``mount``.
    """

    version: int
    directory: Path
    mount: Path


@dataclass(frozen=True)
class CgroupSnapshot:
    """One reading of the memory cgroup, for ``status`` and the ledger (``None`` = not available)."""

    version: int
    directory: str
    limit: int | None
    usage: int | None
    working_set: int | None
    oom_kills: int | None


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """Parse ``/proc/self/cgroup``; return ``(v2_path, v1_memory_path)``, either ``None`` when absent.

    v2 lines read ``0::/path``; v1 lines ``N:controllers:/path`` where controllers is a comma list
    (``4:memory:/a`` or ``7:cpu,memory:/a``). Malformed lines are skipped.
    """
    v2_path: str | None = None
    v1_path: str | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    return v2_path, v1_path


def locate(root: str | Path = "/") -> CgroupMemory | None:
    """Find this process's memory cgroup below ``root``; ``None`` when there is none (macOS, no cgroupfs)."""
    base = Path(root)
    proc = _read_text(base / "proc/self/cgroup")
    if proc is None:
        return None
    v2_path, v1_path = parse_proc_cgroup(proc)
    mounts = _cgroup_mounts(_read_text(base / "proc/self/mountinfo"))
    if v1_path is not None:
        mount_point, mount_root = mounts.get(1, (_V1_DEFAULT_MOUNT, "/"))
        found = _resolve(base, 1, v1_path, mount_point, mount_root)
        if found is not None:
            return found
    if v2_path is not None:
        mount_point, mount_root = mounts.get(2, (_V2_DEFAULT_MOUNT, "/"))
        return _resolve(base, 2, v2_path, mount_point, mount_root)
    return None


def memory_limit(group: CgroupMemory) -> int | None:
    """Return the smallest memory limit on ``group`` and its visible ancestors, or ``None`` when unlimited.

    v2 reads ``memory.max`` (the literal ``max`` is no limit) and ``memory.high`` (above it the kernel
    throttles and reclaims hard, which stalls a merge as surely as a limit). v1 reads
    ``memory.limit_in_bytes`` (values ≥ 2⁶⁰ are no limit) and the leaf's ``hierarchical_memory_limit``, which
    also covers ancestors we cannot see.
    """
    names = ("memory.max", "memory.high") if group.version == 2 else ("memory.limit_in_bytes",)
    limits: list[int] = []
    for directory in _ancestry(group):
        for name in names:
            value = _read_limit(directory / name)
            if value is not None:
                limits.append(value)
    if group.version == 1:
        hierarchical = _read_stat(group.directory).get("hierarchical_memory_limit")
        if hierarchical is not None and hierarchical < _V1_UNLIMITED:
            limits.append(hierarchical)
    return min(limits) if limits else None


def memory_usage(group: CgroupMemory) -> int | None:
    """Return the group's charged memory, page cache included (``memory.current`` or ``usage_in_bytes``)."""
    name = "memory.current" if group.version == 2 else "memory.usage_in_bytes"
    return _read_int(group.directory / name)


def inactive_file(group: CgroupMemory) -> int | None:
    """Return the group's inactive file cache from ``memory.stat``, the part the kernel reclaims first.

    v1 prefers ``total_inactive_file`` (which includes child groups, as ``usage_in_bytes`` does) over
    ``inactive_file``.
    """
    stat = _read_stat(group.directory)
    if group.version == 1 and "total_inactive_file" in stat:
        return stat["total_inactive_file"]
    return stat.get("inactive_file")


def working_set(group: CgroupMemory) -> int | None:
    """Return usage minus inactive file cache (kubelet's working set), or ``None`` when usage is unknown.

    Page cache from reading safetensors is charged to the group but is not pressure: the kernel drops it
    before it OOM-kills anybody, so headroom is ``limit - working_set``, not ``limit - usage``.
    """
    usage = memory_usage(group)
    if usage is None:
        return None
    return max(0, usage - (inactive_file(group) or 0))


def oom_kill_count(group: CgroupMemory) -> int | None:
    """Return how many processes the kernel OOM-killed in this group (``oom_kill``), or ``None`` if unknown.

    v2 reads ``memory.events``; v1 reads ``memory.oom_control`` (the counter exists from Linux 4.13). The
    engine stores it at start so a resume can say the previous run was killed for memory.
    """
    name = "memory.events" if group.version == 2 else "memory.oom_control"
    return _parse_key_values(_read_text(group.directory / name)).get("oom_kill")


def read_snapshot(root: str | Path = "/") -> CgroupSnapshot | None:
    """Locate the memory cgroup below ``root`` and read everything ``status`` shows; ``None`` without one."""
    group = locate(root)
    if group is None:
        return None
    return CgroupSnapshot(
        version=group.version,
        directory=str(group.directory),
        limit=memory_limit(group),
        usage=memory_usage(group),
        working_set=working_set(group),
        oom_kills=oom_kill_count(group),
    )


def _resolve(base: Path, version: int, path: str, mount_point: str, mount_root: str) -> CgroupMemory | None:
    mount = base / mount_point.lstrip("/")
    if not mount.is_dir():
        return None
    # Without a cgroup namespace the mount shows the hierarchy from mount_root down (e.g. /docker/<id>), while
    # /proc/self/cgroup names the full path; strip the prefix. A path outside the mount means the group itself
    # is the mount (a namespaced container), as does a path that names no directory we can see.
    if mount_root == "/":
        relative = path
    elif path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        relative = path[len(mount_root) :]
    else:
        relative = ""
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    directory = mount.joinpath(*parts) if parts and ".." not in parts else mount
    if not directory.is_dir():
        directory = mount
    return CgroupMemory(version=version, directory=directory, mount=mount)


def _cgroup_mounts(mountinfo: str | None) -> dict[int, tuple[str, str]]:
    """Map cgroup version to (mount point, mount root) from ``/proc/self/mountinfo`` (first match wins)."""
    found: dict[int, tuple[str, str]] = {}
    for line in (mountinfo or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, super_options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            version = 2
        elif fstype == "cgroup" and "memory" in super_options:
            version = 1
        else:
            continue
        found.setdefault(version, (_unescape(fields[4]), _unescape(fields[3])))
    return found


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as three octal digits (\040 for a space).
    out: list[str] = []
    i = 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _ancestry(group: CgroupMemory) -> list[Path]:
    chain = [group.directory]
    current = group.directory
    while current != group.mount and current.parent != current:
        current = current.parent
        chain.append(current)
    return chain


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _read_limit(path: Path) -> int | None:
    text = _read_text(path)
    if text is None or text.strip() == "max":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value < _V1_UNLIMITED else None


def _read_stat(directory: Path) -> dict[str, int]:
    return _parse_key_values(_read_text(directory / "memory.stat"))


def _parse_key_values(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                values[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return values
