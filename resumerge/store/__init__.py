"""Where committed files go and how resumerge remembers them: the output sink, durable writes, the ledger, the
manifest, checksums, and the status views read from them.

The commit protocol lives here (temp, fsync, rename, fsync dir, then the ledger row); the engine writes every
output file through an :class:`~resumerge.store.sink.OutputSink` and never learns whether OUT is a local
directory, a staged remote mount or a hub repo (``hub*.py``: access checks, batched uploads and commits).

May import: errors, config, inputs (the safetensors format, tensor bytes, the hub client helpers).
"""

__all__ = [
    "checksums",
    "diskprobe",
    "durable",
    "filesystems",
    "hubcommits",
    "hubrepo",
    "hubsink",
    "hubstatus",
    "integrity",
    "killpoints",
    "ledger",
    "manifest",
    "runlock",
    "shardwriter",
    "statusview",
]
