"""Execute a plan: sessions that start, resume and stop merges, the pipeline that computes tensors and commits files,
estimates, and the multi-stage recipe runner.

The only stage that reads weights and writes output files — through the input sources and the output sink,
whichever they are.

May import: errors, config, memory, methods, vocab, inputs, store, plan, outputs, extract (its planner).
"""

__all__ = [
    "devices",
    "estimate",
    "executor",
    "hubout",
    "recipe_estimate",
    "recipe_run",
    "reconcile",
    "session",
]
