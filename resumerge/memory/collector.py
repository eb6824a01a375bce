"""The cyclic garbage collector held off while a plan is built, which allocates millions of long-lived objects.

Python runs a full collection each time the objects alive grow by a quarter; planning DeepSeek-V3 x R1 (92k tensors
a model, each with its references and codecs) made it walk the growing heap again and again: about a fifth of the
plan's CPU time, for no garbage (planning makes few reference cycles, and those are freed when the collector runs
again after the block). Reference counting still frees everything else at once.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled, then enable it again if it was enabled before
    (so nested blocks leave it as the outermost found it), whether the block returns or raises."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
