"""A merge spread over a Ray cluster: each pending output shard is one Ray task, the driver alone journals.

The driver (:class:`~resumerge.engine.cluster.driver.RayExecutor`, the executor of ``--executor ray``) plans as
every run does, then hands each pending shard to a task as a plan fragment (the frozen plan, shared once through
Ray's object store, and the shard's name and temp folder; never tensors). The task
(:func:`~resumerge.engine.cluster.worker.compute_shard`) reads its inputs itself, computes and writes the shard
with the engine's own pipeline and returns its digests; the driver publishes it through the run's sink and
journals it, exactly as the local executor does, so the ledger stays the one source of truth and a run started
with one executor resumes with the other. Ray itself is imported only here, and only when a run asks for it
(:mod:`~resumerge.engine.cluster.connect`).

May import: errors, config, memory, methods, inputs, store, plan, engine (the executor seam and its pipeline).
"""

__all__ = ["connect", "driver", "worker"]
