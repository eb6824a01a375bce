"""The machine every floor stands on: what resumerge needs of the computers it runs on, and no part of a merge.

Durable writes (:mod:`.durable`: temp, fsync, rename, fsync of the folder) and the checksums they record
(:mod:`.checksums`), the named points where a test kills the process (:mod:`.killpoints`), the locks a run or a
job holds (:mod:`.runlock`, :mod:`.planning`), a job's thread count kept in its folder (:mod:`.threadcount`), the
disks and filesystems a path lives on (:mod:`.diskprobe`, :mod:`.filesystems`), torch imported on its first use
(:mod:`.torch_import`), the memory governor (:mod:`.memory`), the Ray cluster, found and joined
(:mod:`.rayconnect`), and the workers kept on its nodes that host a merge's shard stream or a forward pass
(:mod:`.cluster`). Every other layer may import it; it imports nothing above ``config``.

May import: errors, config.
"""

__all__ = [
    "checksums",
    "cluster",
    "diskprobe",
    "durable",
    "filesystems",
    "killpoints",
    "memory",
    "planning",
    "rayconnect",
    "runlock",
    "threadcount",
    "torch_import",
]
