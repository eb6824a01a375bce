"""Models run side by side over the same token sequences, as a check compares them, with their heads and the bytes
their steps hold.

The pass (:mod:`.passes`): the merge first, one decoder layer at a time, in float32; the heads and the figures from
their log-probabilities (:mod:`.heads`, which eval and the search stream too); the bytes each step holds
(:mod:`.needs`), from which a budget is found.

May import: errors, config, inputs, machine, merge.engine (the unwritten merge), forward.engine, forward.text,
forward.opening, forward.job.
"""

__all__ = [
    "heads",
    "needs",
    "passes",
]
