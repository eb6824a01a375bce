"""Where committed files go and how resumerge remembers them: the output sink, the ledger, the manifest, and the
status views read from them (the ledgers read-only: ``ledger_read``, standard library only).

The commit protocol's one owner lives here (``journal_commit``: a file published through the sink, its temp, fsync,
rename and fsync of the folder done by :mod:`resumerge.machine.durable`; then the ledger row and the manifest, in
durability order); the engine writes every output file through an
:class:`~resumerge.merge.store.sink.OutputSink` and waits on the receipt publishing returns, never learning whether OUT
is a local directory, a staged remote mount, a hub repo (``hub*.py``: access checks, batched uploads and commits)
or a dict (``memsink``, for tests and notebooks). Durable writes, checksums, the run's locks and kill points are the
bottom package's (:mod:`resumerge.machine`): every floor uses them, not the merge alone.

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
