"""Which filesystem a path lives on, and whether output there must be staged on local disk first.

Google Drive in Colab is a FUSE mount whose uploads happen behind the kernel's back: a file can be renamed and
fsynced yet still be half-synced, and the mount can vanish with the runtime. Network filesystems have cousins of
these problems. On such filesystems resumerge writes and fsyncs each shard on local staging and publishes it to
OUT by copy + read-back verify (see :func:`resumerge.machine.durable.publish_copy`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from resumerge.config.locations import STAGING_NAME
from resumerge.config.settings import Staging
from resumerge.machine.diskprobe import nearest_existing

MOUNTINFO = Path("/proc/self/mountinfo")
# Filesystem types whose durability or visibility resumerge does not take on trust.
_REMOTE_PREFIXES = ("fuse", "nfs", "cifs", "smb", "9p", "sshfs", "afs", "ceph", "glusterfs", "gcsfuse", "drive")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: where a filesystem is mounted and its type (``ext4``, ``fuse.drive``...)."""

    point: str
    fstype: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts listed in ``text`` (the format of ``/proc/self/mountinfo``); malformed lines are skipped.

    Field 5 is the mount point (octal escapes such as ``\\040`` for a space), and the type follows the
    ``-`` separator.
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        after = fields[fields.index("-") + 1 :]
        if not after:
            continue
        mounts.append(Mount(_unescape(fields[4]), after[0]))
    return mounts


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` (its nearest existing ancestor), or None when unknown."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return None
    target = _resolved(path)
    best: Mount | None = None
    for mount in parse_mountinfo(mountinfo):
        point = Path(mount.point)
        if (target == point or point in target.parents) and (best is None or len(mount.point) >= len(best.point)):
            best = mount  # the last and longest match wins: later mounts hide earlier ones
    return best.fstype if best else None


def needs_staging(path: Path, mountinfo: str | None = None) -> bool:
    """True when output under ``path`` should be staged locally and published by copy + verify."""
    fstype = filesystem_type(path, mountinfo)
    return fstype is not None and fstype.lower().startswith(_REMOTE_PREFIXES)


def staging_dir(choice: Staging, out: Path, run_dir: Path) -> Path | None:
    """Where output files are staged before they reach ``out``, or None to write into ``out`` directly.

    ``choice``: None stages only when ``out`` is on a remote or FUSE filesystem, True always, False never, or a
    directory to stage in; the default place is the run's state folder ``run_dir``.
    """
    if choice is False or (choice is None and not needs_staging(out)):
        return None
    return run_dir / STAGING_NAME if choice is None or choice is True else Path(os.path.abspath(choice))


def _resolved(path: Path) -> Path:
    """``path`` with symlinks of its existing part resolved (OUT may not exist yet)."""
    absolute = Path(os.path.abspath(path))
    existing = nearest_existing(absolute)
    return Path(os.path.realpath(existing)) / absolute.relative_to(existing)


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 3 < len(text) and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
