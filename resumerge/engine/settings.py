"""How a run is carried out, as one frozen object: everything the user may change between two runs of the same
merge without changing a byte of its output.

:class:`~resumerge.plan.merge_plan.PlanOptions` holds what does change the output (it is part of the plan's
fingerprint); :class:`RunSettings` holds the rest — where state and the hub cache live, the memory, GPU and disk
budgets, staging, how an ``hf://`` OUT is committed, and the threads. :mod:`resumerge.api` builds one from its
keyword parameters; every engine layer below takes it whole instead of a parameter per knob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from resumerge.store.filesystems import Staging
from resumerge.store.hubsink import HubOutputOptions

# Units computed at once by the engine's merge threads (two keep the writer busy; see executor.py).
CONCURRENCY = 2


@dataclass(frozen=True)
class RunSettings:
    """The settings of one run that never change its output bytes (a resume may pass others than the first run).

    ``state_dir`` holds ledgers (default: :func:`resumerge.config.locations.state_root`'s); ``cache_dir`` is the
    Hugging Face cache for hub models (``--transformers-cache``). ``max_memory`` and ``max_gpu_memory`` are budgets
    in bytes (None: a safe fraction of what the machine, container or GPU allows). ``staging``: None stages output
    on local disk only when OUT is remote (Drive), True always, False never, or a directory to stage in.
    ``max_disk`` bounds the bytes kept on the local disk for the output (an ``hf://`` OUT's uncommitted files);
    ``output`` says how an ``hf://`` OUT is created and its commits batched. ``num_threads`` is torch's thread count
    (None: torch's choice) and ``workers`` the units computed at once.
    """

    state_dir: str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    max_memory: int | None = None
    max_gpu_memory: int | None = None
    staging: Staging = None
    max_disk: int | None = None
    output: HubOutputOptions = field(default_factory=HubOutputOptions)
    num_threads: int | None = None
    workers: int = CONCURRENCY
