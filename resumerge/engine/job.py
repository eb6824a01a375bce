"""What the session hands an executor (:mod:`resumerge.engine.executors`): one run's pending work, whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from resumerge.config.settings import RunSettings
from resumerge.engine.inputfetch import HubInputs
from resumerge.engine.reporting import Reporter
from resumerge.inputs.source import InputSources
from resumerge.memory import MemoryGovernor
from resumerge.methods.resources import Resources
from resumerge.plan.merge_plan import Plan
from resumerge.store.ledger import Ledger
from resumerge.store.manifest import ManifestBook
from resumerge.store.sink import OutputSink


@dataclass(frozen=True)
class Job:
    """One run's pending work as the session hands it over: the frozen plan, where its inputs are read and its
    files committed, the ledger and manifest that journal them, and how the run is watched and stopped (the
    parameters of :func:`~resumerge.engine.executors.execute`, which describes them; ``hub`` the run's hub inputs,
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
