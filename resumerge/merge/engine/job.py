"""What the session hands an executor (:mod:`resumerge.merge.engine.executors`): one run's pending work, whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from resumerge.config.settings import RunSettings
from resumerge.inputs.source import InputSources
from resumerge.machine.memory import MemoryGovernor
from resumerge.merge.engine.inputfetch import HubInputs
from resumerge.merge.engine.reporting import Reporter
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import ManifestBook
from resumerge.merge.store.sink import OutputSink


@dataclass(frozen=True)
class Job:
    """One run's pending work as the session hands it over: the frozen plan, where its inputs are read and its
    files committed, the ledger and manifest that journal them, and how the run is watched and stopped (the
    parameters of :func:`~resumerge.merge.engine.executors.execute`, which describes them; ``hub`` the run's hub inputs,
    whose streamed files a cluster's nodes read themselves)."""

    plan: Plan
    sources: InputSources
    sink: OutputSink
    ledger: Ledger
    book: ManifestBook
    reporter: Reporter
    should_stop: Callable[[], bool]
    config_text: str
    resources: Resources
    settings: RunSettings
    governor: MemoryGovernor | None = None
    gpu: MemoryGovernor | None = None
    late_notes: Callable[[], tuple[str, ...]] | None = None
    transfers: bool = False
    hub: HubInputs | None = None
