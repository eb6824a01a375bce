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
generation instead (:func:`gc.freeze`), as the engine does for its run (:func:`alive_frozen`).

A freeze is the whole process's: :func:`gc.unfreeze` thaws every object frozen, whoever froze it. So the product
thaws only what it froze, and freezes only where nothing is frozen yet: a caller's own freeze (a notebook's, a
server's before it forks) stays as it was, and the product adds nothing to it
that could never be collected again.
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


@contextmanager
def alive_frozen() -> Iterator[None]:
    """Run the block with the objects alive as it starts moved to the permanent generation (:func:`gc.freeze`), and
    back into the oldest generation when it ends, whether it returns or raises: the block's own garbage makes the
    collector run, and its full collections would walk all of them again and again (a run beside its 90k-tensor
    plan's million objects: execute CPU 94.4 s -> 67.2 s frozen). Where something is frozen already (by the caller,
    or by an outer or concurrent block) the block runs with nothing more frozen: a thaw would take the caller's
    objects too, and objects frozen for good would leave their cycles (a run's plan, its tensors) uncollectable
    after the block let them go."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
