"""A tokenizer transplant (:func:`resumerge.api.tokensurgeon`): MODEL's weights with DONOR's vocabulary, planned by
:mod:`resumerge.runs.transplant`; its recorded text is the transplant's options, which a resume plans again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from resumerge.api.keptwork import KeptWorkKind
from resumerge.api.runkind import PathLike
from resumerge.runs.transplant.spec import MARK

if TYPE_CHECKING:
    from resumerge.config.locations import RunLocations, StateDir
    from resumerge.config.settings import RunSettings
    from resumerge.inputs.hub import HubEvent
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.prepared import Prepared
    from resumerge.merge.store.statusview import Details, StatusReport


class SurgeryKind(KeptWorkKind):
    """A transplant. Each approximated batch of tokens is kept in the run's state folder until the run is done
    (a resumed run computes only the batches not finished), then deleted. Its plan reads the two tokenizers, no
    weight."""

    name = "tokensurgeon"
    mark = MARK  # a transplant's options (:func:`~resumerge.runs.transplant.spec.spec_text`)
    started_by = "resumerge tokensurgeon MODEL DONOR"

    def prepared(self, text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None,
                 model_dirs: Mapping[str, str] | None, on_progress: Callable[[HubEvent], None] | None) -> Prepared:
        from resumerge.runs.transplant.prepare import prepare_surgery

        made = prepare_surgery(text, options, settings, out=out, model_dirs=model_dirs, on_progress=on_progress)
        _give_back()
        return made

    def clear(self, out: PathLike, state: StateDir) -> None:
        from resumerge.runs.transplant.prepare import batch_store

        batch_store(out, state).clear()

    def forget(self, outcome: Outcome, out: PathLike, state: StateDir) -> None:
        if outcome.plan.method == "tokensurgeon":
            self.clear(out, state)

    def details(self, report: StatusReport, where: RunLocations) -> Details | None:
        """The approximated batches kept so far while the matrices are computed."""
        from resumerge.merge.store.statusview import Details
        from resumerge.runs.transplant.batches import BATCHES_DIR, SUFFIX

        directory = where.run_dir / BATCHES_DIR
        try:
            kept = sum(1 for _ in directory.glob("*" + SUFFIX))
        except OSError:
            kept = 0
        if report.state == "done" or not kept:
            return None
        return Details(rows=(("batches approximated", str(kept)),), data={"batches_done": kept})


def _give_back() -> None:
    """Collect the two tokenizers the planning let go and hand the heap's free pages back to the OS
    (``malloc_trim``) before the units run. A 262,144-token tokenizer's Python vocabulary and transformers' objects
    take ~370 MB while the match is made; freed, glibc kept ~160 MB of it in the heap for the rest of the run, under
    the approximation's peak (Gemma-3-270M ← SmolLM2: 590 MB resident after the match, 432 MB trimmed)."""
    import gc

    from resumerge.machine.memory.allocator import malloc_trim

    gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)
