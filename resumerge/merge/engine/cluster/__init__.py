"""A merge spread over a Ray cluster: the pending output shards fed to a long-lived worker per node, the driver
alone journals.

The driver (:class:`~resumerge.merge.engine.cluster.driver.RayDriver`, the executor of ``--executor ray``) plans as
every run does, with a worker actor per node started meanwhile (:mod:`~resumerge.merge.engine.cluster.warm`, adopted or
ended by
:mod:`~resumerge.machine.cluster.launch`), hands it the frozen plan (shared once through Ray's object store) and
feeds it shards, a few ahead, by name and temp folder, never tensors. The worker
(:class:`~resumerge.merge.engine.cluster.worker.ShardStream`) reads their inputs itself (streamed hub inputs by byte
range from the hub, through a fetch cache of its node's: :mod:`~resumerge.merge.engine.cluster.hubreads`), computes and
writes them with the engine's own pipeline (one shard's write overlapping the next one's compute) and returns each one's
digests; the driver publishes it through the run's sink and journals it, exactly as the local executor does (for a hub
OUT the node uploads the shard itself and the driver only commits it: :mod:`~resumerge.merge.engine.cluster.upload`), so
the ledger stays the one source of truth and a run started with one executor resumes with the other. On a cluster that
outlives the run the workers are kept for the next run (:mod:`~resumerge.machine.cluster.kept`, leased and watched
by
:mod:`~resumerge.machine.cluster.keeper`), and they host the forward passes' actors between runs
(:mod:`~resumerge.machine.cluster.hosting`). Ray itself is imported only when a run asks for it
(:mod:`~resumerge.machine.rayconnect`, the bottom package's).

May import: errors, config, machine, merge.methods, inputs, merge.store, merge.plan, merge.engine (the executor seam
and its pipeline).
"""

# The class a node's worker computes a merge's shards with, by name: every worker the driver or a pass starts makes
# one in its own process (:class:`~resumerge.machine.cluster.actor.NodeActor`), which the driver never imports.
STREAM = "resumerge.merge.engine.cluster.worker:ShardStream"

__all__ = ["STREAM", "cores", "driver", "warm", "worker"]
