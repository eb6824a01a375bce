"""A LoRA extraction: a fine-tune's adapter against its base (:func:`resumerge.api.extract_lora`), planned by
:mod:`resumerge.runs.extract`; its recorded text is the extraction's spec, which a resume plans again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from resumerge.api.keptwork import KeptWorkKind
from resumerge.api.runkind import PathLike
from resumerge.runs.extract.state import EXTRACTION_MARK

if TYPE_CHECKING:
    from resumerge.config.locations import RunLocations, StateDir
    from resumerge.config.settings import RunSettings
    from resumerge.inputs.hub import HubEvent
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.prepared import Prepared
    from resumerge.merge.store.statusview import Details, StatusReport


class ExtractionKind(KeptWorkKind):
    """A LoRA extraction. Each module's factors are kept in the run's state folder until the adapter is
    committed (a resumed run decomposes only the modules not finished), then deleted. Its plan reads the weights
    with ``--sv-epsilon`` (to count each module's rank)."""

    name = "extraction"
    started_by = "resumerge extract-lora --model FT --base-model BASE"
    mark = EXTRACTION_MARK  # an extraction's spec (:func:`~resumerge.runs.extract.spec.spec_text`)

    def prepared(self, text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None,
                 model_dirs: Mapping[str, str] | None, on_progress: Callable[[HubEvent], None] | None) -> Prepared:
        from resumerge.runs.extract.prepare import prepare_extraction

        return prepare_extraction(text, options, settings, out=out, model_dirs=model_dirs, on_progress=on_progress)

    def clear(self, out: PathLike, state: StateDir) -> None:
        from resumerge.runs.extract.prepare import clear_factors

        clear_factors(out, state)

    def forget(self, outcome: Outcome, out: PathLike, state: StateDir) -> None:
        from resumerge.runs.extract.prepare import forget_factors

        forget_factors(outcome.plan, out, state)

    def details(self, report: StatusReport, where: RunLocations) -> Details | None:
        """The adapter's modules (its one file moves only at the end, the modules one by one), from this kind's own
        plan (each module's factor A): every one done once the adapter is committed; before that, those whose
        factors are in the run's factor cache, and the one decomposed now (running) or next (interrupted)."""
        from resumerge.merge.store.ledger_read import tensor_names
        from resumerge.merge.store.statusview import Details
        from resumerge.runs.extract.state import FACTORS_DIR, cached_modules, lora_modules

        if report.source != "ledger":
            return None
        names = tensor_names(where.ledger)
        modules = lora_modules(names)
        if not modules:
            return None
        total = len(modules)
        if report.tensors_done and report.tensors_done == len(names):
            return Details(counts=(("modules", total, total, "decomposed"),),
                           data={"modules_total": total, "modules_done": total})
        cached = cached_modules(where.run_dir / FACTORS_DIR)
        pending = [m for m in modules if m not in cached]
        current = pending[0] if pending else None
        label = "decomposing" if report.state == "running" else "next module"
        return Details(counts=(("modules", total - len(pending), total, "decomposed"),),
                       rows=((label, current),) if current is not None else (),
                       data={"modules_total": total, "modules_done": total - len(pending),
                             "module_current": current})
