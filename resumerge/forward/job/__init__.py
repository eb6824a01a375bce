"""The one journaled layer pass every analysis runs on, and its driver: a pass is a job (:class:`~.driver.PassJob`)
that :func:`~.driver.drive` runs always in the same order: the folder's lock (:mod:`.folder`), the answer cache, the
thread count kept in the folder (:mod:`.threads`), the content proof of the local models (:mod:`.proof`), the fit,
each step's admission by the RAM governor (:mod:`.admission`), the loop, the end.

The loop (:class:`~.layerpass.LayerPass`) restarts from the pass's journal (:mod:`.journal`: one file per decoder
layer, saved durably), hands each layer to the client's :class:`~.layerpass.Step`, saves what leaves it and reaches
the pass's kill point. Where the models run is a :class:`~.placement.Placement` (:class:`~.placement.Streams`: every
model in this process, one layer at a time); the executors' own placements are :mod:`resumerge.forward.placing`'s.

May import: errors, config, inputs, machine, forward.engine, forward.text, forward.opening.
"""

__all__ = [
    "admission",
    "driver",
    "folder",
    "journal",
    "layerpass",
    "placement",
    "proof",
    "threads",
]
