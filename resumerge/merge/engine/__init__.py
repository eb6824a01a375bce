"""Execute a plan: the one session path that starts, resumes and stops a merge (``target`` opens OUT, ``session``
runs a frozen plan into it under one ``settings`` object) and the pipeline that computes tensors and commits files.
What a run will cost is :mod:`resumerge.analyses.estimate`, a package above this one.

The only stage that reads weights and writes output files — through the input sources and the output sink,
whichever they are. Every kind of run (a single merge, each stage of a recipe, the kinds later issues add) is a
planner that makes a :class:`~resumerge.merge.plan.prepared.Prepared`, then
:func:`resumerge.merge.engine.session.run_plan`; the kinds themselves live above (:mod:`resumerge.api.kinds`) and never
reach the engine as anything but a plan.

May import: errors, config, machine, merge.methods, merge.vocab, inputs, merge.store, merge.plan, outputs.
"""

__all__ = [
    "devices",
    "executor",
    "frozenplan",
    "hubout",
    "reconcile",
    "session",
    "settings",
    "target",
]
