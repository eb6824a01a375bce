"""Where committed files go and how resumerge remembers them: the output sink, durable writes, the ledger, the
manifest, checksums, and the status views read from them (the ledgers read-only: ``ledger_read``, standard
library only).

The commit protocol lives here (temp, fsync, rename, fsync dir in ``durable``; then the ledger row and the
manifest, in ``journal_commit``, the protocol's one owner); the engine writes every output file through an
:class:`~resumerge.merge.store.sink.OutputSink` and waits on the receipt publishing returns, never learning whether OUT
is a local directory, a staged remote mount, a hub repo (``hub*.py``: access checks, batched uploads and commits)
or a dict (``memsink``, for tests and notebooks).

May import: errors, config, machine, inputs (the safetensors format, tensor bytes, the hub client helpers), outputs.
"""

__all__ = [
    "hubcommits",
    "hubrepo",
    "hubretry",
    "hubsink",
    "hubstatus",
    "integrity",
    "journal",
    "journal_commit",
    "ledger",
    "ledger_read",
    "manifest",
    "memsink",
    "recommit",
    "shardwriter",
    "sqlitedb",
    "statusview",
]
