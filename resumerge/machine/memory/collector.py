"""The cyclic garbage collector held off while a plan is built, which allocates millions of long-lived objects.

Python runs a full collection each time the objects alive grow by a quarter; planning DeepSeek-V3 x R1 (92k tensors
a model, each with its references and codecs) made it walk the growing heap again and again: about a fifth of the
plan's CPU time, for no garbage (planning makes few reference cycles, and those are freed when the collector runs
again after the block). Reference counting still frees everything else at once.

Re-enabled after the block, the collector still meets what the block built on its next collections: the first
walks every object the block left alive, and which generation it collects then (hence whether a full collection
over the whole heap follows within moments) depends on the counters the process's earlier allocations (its
imports) left. A process that holds the block's objects until it ends (``resumerge plan``: its Estimate holds the
plan it prints) loses those walks for nothing: measured on DeepSeek-V3 x R1's plan from ``hf://``, 0.23-0.58 CPU s,
the larger figure once 42 more imported modules had moved the counters. ``freeze`` hands them to the permanent
generation instead (:func:`gc.freeze`), as the engine does for its run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(*, freeze: bool = False) -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled, then enable it again if it was enabled before
    (so nested blocks leave it as the outermost found it), whether the block returns or raises. ``freeze``: when the
    block returns, every object then alive is moved to the permanent generation first (never walked again; only for
    a process that keeps them to its end, since a cycle among them is never freed)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()
