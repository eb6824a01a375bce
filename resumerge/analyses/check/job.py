"""A check as the pass driver runs it (:class:`CheckJob`, a :class:`~resumerge.forward.job.driver.PassJob`): its
report is its answer cache, its steps the static pass and the forward pass (:mod:`resumerge.forward.compared.passes`,
here or on Ray:
:mod:`resumerge.forward.placing.rayactor`), its end the report, the chart, the ledger's event and the model card.
:mod:`.run` finds the models and the texts, keys the check's folder and hands this job to the driver."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.check.card import run_state, update_card
from resumerge.analyses.check.chart import write_drift_chart
from resumerge.analyses.check.folded import FoldedStatic
from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.progress import PROGRESS_NAME, Progress, Watcher
from resumerge.analyses.check.report import CheckReport, ModelFigures, StaticFigures
from resumerge.analyses.check.static import TensorResult, logical_shapes, static_pass, tensor_results
from resumerge.analyses.check.strict import finite
from resumerge.analyses.check.verdict import THRESHOLDS, judge
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir
from resumerge.config.passplace import HERE, PassPlace
from resumerge.errors import PlanChangedError, UsageError
from resumerge.forward.compared.needs import StepBytes, settled_held, step_bytes
from resumerge.forward.compared.passes import LAYER_PREFIX, PassFigures, run_pass, streams_of
from resumerge.forward.engine.device import HOST, PassDevice
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import Fit, PassFolder
from resumerge.forward.job.journal import Journal
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.job.proof import RECORDS_NAME, Depends, PassProof, everything, layers_through
from resumerge.forward.opening.hubreads import PassReads
from resumerge.forward.opening.opened import layer_of
from resumerge.forward.placing.sites import PassSite, Seats, Told, site_of
from resumerge.forward.text.texts import describe
from resumerge.forward.text.tokens import Texts
from resumerge.forward.text.vocabs import SharedVocab, model_rows
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.memory.allocator import malloc_trim, tune_allocator
from resumerge.machine.torch_import import load as load_torch

if TYPE_CHECKING:
    from resumerge.forward.placing.onray import Read

REPORT_NAME = "report.json"
CHART_NAME = "drift.png"
STATIC_NAME = "static.json"
OUTSIDE_NAME = "static-outside.json"  # the static figures of the tensors outside the decoder layers (folding)


def stopped_at(model: str | os.PathLike[str], workdir: Path) -> str:
    """Where the interrupted check of ``model`` in ``workdir`` stopped, in words: the layer it was running (from
    its progress file) and the layers its journal holds."""
    from resumerge.forward.job.journal import latest

    try:
        doc = json.loads((workdir / PROGRESS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = {}
    found = latest(workdir, LAYER_PREFIX)
    kept = "none of its layers journaled yet" if found is None else \
        f"layers 1-{found[0] + 1} journaled" if found[0] else "layer 1 journaled"
    layer, layers = doc.get("layer"), doc.get("layers")
    where = f"in layer {layer + 1} of {layers}" if isinstance(layer, int) else \
        "in the static pass" if doc.get("phase") == "static" else "before its first layer"
    if found is not None and isinstance(layer, int) and found[0] >= layer:
        where = f"after layer {found[0] + 1} of {layers}"
    if doc.get("phase") == "heads":
        where = "in the heads, after its last layer"
    return f"the check of {model} was interrupted {where} ({kept})"



@dataclass(frozen=True, kw_only=True)
class CheckSettings:
    """How a check runs (none of it in its key): under ``max_memory`` (None: the default budget), journaled under
    ``state``, its models where the executor placed them (``placement``: here, or each model's forward pass on a
    node of a Ray cluster, :mod:`resumerge.forward.placing.rayactor`, with the same report), its layers and heads on
    ``device`` (a GPU: each layer moved there while it runs, each step admitted by the GPU's budget too:
    :mod:`resumerge.forward.engine.device`); a checked merge's ledger looked for in ``state``, then in ``default_state``
    (the state dir a command given no ``--state-dir`` uses, as the API resolved it; None: ``state`` alone), for its
    ``check`` event and its card (:func:`~.card.run_state`)."""

    state: StateDir
    max_memory: int | None = None
    placement: PassPlace = HERE
    device: PassDevice = HOST
    default_state: StateDir | None = None

    @property
    def site(self) -> PassSite:
        """Where the models run, as the check asks it (:mod:`resumerge.forward.placing.sites`)."""
        return site_of(self.placement)


@dataclass(frozen=True)
class _Ready:
    """What a check's fit made, held open while it runs: its models as its hub reads bind them, their modules
    (``streams``), its progress, the hub reads' journal, whether the static pass folds into the layers' reads, and
    where its models were placed (``seats``)."""

    models: list[Checked]
    streams: list[ModelStream]
    progress: Progress
    reads: PassReads
    can_fold: bool
    seats: Seats


@dataclass(frozen=True)
class _Found:
    """What a check's pass found: the static figures, the forward pass's (None where it did not run)."""

    ready: _Ready
    static: StaticFigures
    figures: PassFigures | None


@dataclass(frozen=True)
class CheckJob:
    """A check as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): its report is the answer
    cache; its steps are the static pass and the forward pass (:mod:`resumerge.forward.compared.passes`); its end the
    report, the chart, the ledger's event and the card."""

    folder: PassFolder
    model: str | os.PathLike[str]
    models: list[Checked]
    texts: Texts
    prompts_file: Path | None
    settings: CheckSettings
    watcher: Watcher | None
    proof: PassProof

    def answered(self) -> tuple[CheckReport | None, str | None]:
        """The report of a check that finished (the card brought up to date with it); or None, and where a model
        changed since that report, a line saying so (the check runs again, from the start)."""
        workdir, proof = self.folder.path, self.proof
        proof.records = workdir / RECORDS_NAME
        if not (workdir / REPORT_NAME).is_file():
            return None, None
        try:
            proved = proof.prove(everything, refuse="its report is of those bytes", hint="")
        except PlanChangedError as exc:  # a report of bytes a model no longer holds: checked again, from the start
            _start_over(workdir, proof)
            proof.record()  # before the first journal file: whatever the check journals, its bytes are recorded
            return None, f"{exc.path} changed since its last check (in a range the check reads): checked again"
        proof.record()  # the new look of a file touched, its bytes the same
        report = replace(CheckReport.from_json(json.loads((workdir / REPORT_NAME).read_text())),
                         prompts=describe(self.prompts_file), proof=proved.line())
        return replace(report, card=update_card(self.model, self.settings.state, report,
                                                 self.settings.default_state)), None

    def proved(self) -> str | None:
        """What the journal of a resumed check holds, proved against the bytes (and those bytes recorded)."""
        workdir = self.folder.path
        # The pass imports torch (1-2 s of one core): now, while the proof's threads hash the models' bytes outside
        # the GIL, not after its wait (a first check's tokenizer, read without transformers, no longer covers it).
        load_torch()
        # A resumed check: what its journal holds was computed from the bytes the models held then.
        said = self.proof.prove(_journal_depends(workdir), refuse="the check's journal holds figures computed from "
                                "the bytes it held then", hint=f"restore the file as it was and check again (it "
                                f"resumes), or delete {workdir} to check the file as it is now from the start").line()
        self.proof.record()  # before the first journal file: whatever the check journals, its bytes are recorded
        return said

    @contextmanager
    def fitted(self) -> Iterator[Fit[_Ready]]:
        """The models bound to the hub reads' journal, their modules built, the check's fit (:func:`_fits`) and
        the GPU's, and where the models run (placed: on Ray each model's node); the modules closed and the
        allocator put back as the block ends (the kept ranges stay for a resume; where a file failed its check, the
        journal goes)."""
        workdir, settings, tokens, site = self.folder.path, self.settings, self.texts.tokens, self.settings.site
        from resumerge.merge.store.ledger import Ledger

        # A hub model's ranges checked (journaled in workdir, a ledger), its files verified whole.
        reads = PassReads(workdir, Ledger)
        models = site.bind(reads, self.models, fresh=not _journaled(workdir))
        streams = streams_of(models, settings.device.name)
        progress = Progress(workdir, self.model, streams[0].layers, len(models), self.watcher,
                            sum(len(t) - 1 for t in tokens), self.folder.command)
        restore_allocator = tune_allocator()  # freed layers go back to the OS: RSS follows what is held
        error: BaseException | None = None
        try:
            sizes = step_bytes(streams, tokens)
            # before any weight is read
            budget, steps, can_fold = _fits(streams, tokens, settings.max_memory, site.here, sizes)
            gpu = settings.device.budget("the check", steps, 2 * len(streams) * sizes.states)  # the GPU's, on one
            seats = site.seat(lambda: _actor_bytes(sizes), "check", settings.state)  # can the cluster hold them?
            _give_back()  # what the imports, the tokenizer and the modules' construction left free

            # Each layer and each pair of heads is admitted by the RAM governor, as the merge's tensors are: it
            # sees the process's RSS, gives freed memory back when a step would not fit, and refuses (exit 2)
            # rather than pass the budget.
            def before(what: str, step: str) -> None:
                if step == "heads":
                    progress.say(phase="heads", layer=None, model_index=None, model_role=None, model_path=None)
                    _give_back()

            yield Fit(budget, steps, _Ready(models, streams, progress, reads, can_fold, seats), gpu, before)
        except BaseException as exc:
            error = exc
            raise
        finally:
            for stream in streams:
                stream.close()
            if restore_allocator is not None:
                restore_allocator()
            reads.close(clear=False, error=error)

    def run(self, ready: _Ready, reserve: Reserve) -> _Found:
        """The static pass (or its figures outside the layers, the rest folded into the layers' reads), then the
        forward pass, here or on Ray."""
        workdir, models, progress, vocab = self.folder.path, ready.models, ready.progress, self.texts.vocab
        static, fold, outside = _static_before(models, workdir, progress, ready.can_fold,
                                               whole=not self.settings.site.here)
        figures = None
        if static is None or not static.nonfinite:  # broken already: a forward over NaNs tells nothing more

            trimmed = [-1]  # the layer whose first model's step handed the heap's free pages back

            def on_model(layer: int, m: int) -> None:
                if trimmed[0] != layer:
                    trimmed[0] = layer
                    _give_back()
                progress.say(phase="forward", layer=layer, model_index=m, model_role=models[m].role,
                             model_path=models[m].path)

            def on_layer(layer: int, nodes: list[str]) -> None:  # on nodes: ``status`` shows each model's
                progress.say(phase="forward", layer=layer, model_index=None, model_role=None, model_path=None,
                             nodes=nodes, roles=[m.role for m in models])

            def on_reads(m: int, found: list[Read]) -> None:  # held to the journal as this process's own reads
                ready.reads.elsewhere(models[m], found)

            told = Told(on_model, on_layer, on_reads)
            with ready.seats.models(models, ready.streams, told, reserve=reserve, workdir=workdir, fold=fold,
                                    vocab=vocab) as running:
                figures = run_pass([m.role for m in models], running, self.texts.tokens, workdir, fold)
        if static is None:  # the layers' figures found as they were read; what they did not read, read now
            assert fold is not None
            static = _static(models, workdir, progress, {**outside, **fold.found})
            if static.nonfinite:  # as when the static pass finds it first: no forward figures
                figures = None
        ready.reads.finish()  # each file read whole was verified as its last byte came: before the report is written
        return _Found(ready, static, figures)

    def finish(self, found: _Found, proof: str | None) -> CheckReport:
        """The report (and the chart) written, the ledger's event, the journal cleared, the card."""
        workdir, models, figures = self.folder.path, found.ready.models, found.figures
        report = replace(_report(models, found.static, figures, self.texts.tokens, self.texts.vocab),
                         prompts=describe(self.prompts_file), proof=proof)
        workdir.mkdir(parents=True, exist_ok=True)
        if figures is not None and len(models) > 1:  # people would rather look than read
            chart = write_drift_chart(workdir / CHART_NAME, report)
            report = replace(report, chart=os.path.abspath(chart))
        done = workdir / REPORT_NAME
        write_file_atomic(done, (json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False)
                                 + "\n").encode())  # strict JSON: any language's parser reads it
        found.ready.reads.close()  # the ranges kept for a second read go
        found.ready.progress.say(phase="done", verdict=report.verdict, exit_code=report.exit_code,
                                 broken_layer=report.broken_layer)
        _record(self.model, self.settings, report, done)
        Journal(workdir, LAYER_PREFIX).clear()
        return replace(report, card=update_card(self.model, self.settings.state, report, self.settings.default_state))

    def stopped_at(self) -> str:
        """Where the check stopped (:func:`stopped_at`)."""
        return stopped_at(self.model, self.folder.path)


def _actor_bytes(sizes: StepBytes) -> list[int]:
    """The memory each model's actor declares where the models run on Ray nodes
    (:func:`~resumerge.forward.placing.rayactor.actor_bytes`: imported with --executor ray only)."""
    from resumerge.forward.placing.rayactor import actor_bytes

    return actor_bytes(sizes)


def _static_before(models: list[Checked], workdir: Path, progress: Progress, can_fold: bool, whole: bool = False
                   ) -> tuple[StaticFigures | None, FoldedStatic | None, dict[str, TensorResult]]:
    """What the static pass finds before the forward pass: all of it (journaled, or where the layers' figures
    cannot be taken from the forward pass's reads), or, folding, the figures of the tensors outside the decoder
    layers (journaled too), and the :class:`FoldedStatic` that finds the layers' as the forward pass reads them
    (:mod:`.folded`). Where a tensor outside the layers is not finite, all of it: the forward pass will not run.
    ``whole``: the forward pass runs elsewhere (on Ray): every tensor of each hub model is read here, for its files'
    proof (:func:`~.static.static_pass`)."""
    if (workdir / STATIC_NAME).is_file() or not can_fold:
        return _static(models, workdir, progress, whole=whole), None, {}
    path = workdir / OUTSIDE_NAME
    try:
        outside = {name: (bool(finite), sums) for name, (finite, sums) in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        progress.say(phase="static")
        outside = tensor_results(models, only=lambda name: layer_of(name) is None)
        workdir.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, (json.dumps(outside) + "\n").encode())
    if not all(finite for finite, _ in outside.values()):
        return _static(models, workdir, progress, outside), None, outside
    return None, FoldedStatic([m.role for m in models], logical_shapes(models)), outside


def _static(models: list[Checked], workdir: Path, progress: Progress,
            known: dict[str, TensorResult] | None = None, whole: bool = False) -> StaticFigures:
    """The static pass's figures (of the tensors not ``known`` already): journaled in ``workdir`` once found,
    so a resumed check reads no model whole again (it was about a third of a killed and resumed check of
    SmolLM2-135M); ``whole``: see :func:`_static_before`."""
    path = workdir / STATIC_NAME
    if path.is_file():
        return StaticFigures.from_json(json.loads(path.read_text()))
    progress.say(phase="static")
    static = static_pass(models, known, whole=whole)
    workdir.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, (json.dumps(static.to_json(), allow_nan=False) + "\n").encode())  # the table's order
    return static


def _journal_depends(workdir: Path) -> Depends:
    """What of its models' bytes the journal of a check in ``workdir`` depends on: every tensor once its static pass
    is journaled whole; the tensors outside the decoder layers once their static figures, or any layer, are; each
    decoder layer journaled (of every model: the pass runs them all layer by layer)."""
    from resumerge.forward.job.journal import latest

    if (workdir / STATIC_NAME).is_file():
        return everything
    found = latest(workdir, LAYER_PREFIX)
    return layers_through(None if found is None else found[0], outside=(workdir / OUTSIDE_NAME).is_file())


def _start_over(workdir: Path, proof: PassProof) -> None:
    """Everything a check in ``workdir`` found set aside (its report, its static figures, its journal, its chart and
    the records of what it read): it runs again from the start."""
    Journal(workdir, LAYER_PREFIX).clear()
    for name in (REPORT_NAME, STATIC_NAME, OUTSIDE_NAME, CHART_NAME):
        (workdir / name).unlink(missing_ok=True)
    proof.forget()


def _journaled(workdir: Path) -> bool:
    """Whether an earlier run of this check journaled some of its passes (so this one reads less than every
    byte of its models)."""
    return any((workdir / name).is_file() for name in (STATIC_NAME, OUTSIDE_NAME)) or \
        next(workdir.glob(f"{LAYER_PREFIX}*.safetensors"), None) is not None


def _give_back() -> None:
    """Hand the heap's free pages back to the OS (``malloc_trim``) between the check's steps: before the static
    pass, once per layer and before the heads. A run's allocator keeps up to 64 MB free at the top of each heap
    for its next row chunk (:mod:`resumerge.machine.memory.allocator`); the check's steps leave their small temporaries
    there, and without this its peak RSS varied by 50-200 MB from one run of the same check to the next
    (bench/RESULTS.md, issue 57)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def _record(model: str | os.PathLike[str], settings: CheckSettings, report: CheckReport, where: Path) -> None:
    """A ``check`` event in the ledger of ``model`` when it is a resumerge output whose ledger the check finds
    (:func:`~resumerge.analyses.check.card.run_state`): its verdict, exit code, the layer named, each model's NLL and
    KL, and where the report is; the merge's own record then says how it was checked. A model without one (any other
    folder) has no record to add to."""
    from resumerge.errors import LedgerError, StorageError
    from resumerge.merge.store.ledger import Ledger

    if is_hub_target(model) and ".gguf" in os.fspath(model):
        return  # a GGUF file of a hub repo: never a resumerge output (an hf:// OUT is a repo)
    # the run's own ledger: where the card's section is recorded too
    run = run_state(model, settings.state, settings.default_state)
    if run is None:
        return
    path = run.run(model).ledger
    data = {"verdict": report.verdict, "exit_code": report.exit_code, "broken_layer": report.broken_layer,
            "models": [{"role": m.role, "path": m.path, "nll": m.nll, "kl": m.kl} for m in report.models],
            "report": os.path.abspath(where)}
    try:
        ledger = Ledger(path)
        try:
            # strict JSON, as the report's: ``status --json`` shows this row
            ledger.event("check", f"check: {report.verdict.replace('_', ' ')}", finite(data))
        finally:
            ledger.close()
    except (LedgerError, StorageError):  # a damaged ledger is the next run's to set aside; the report stands
        return



def _fits(streams: list[ModelStream], tokens: list[list[int]], max_memory: int | None, can_fold: bool = True,
          sizes: StepBytes | None = None) -> tuple[int, dict[str, int], bool]:
    """Refuse (exit 2, before a weight is read) a check whose peak would not fit ``max_memory`` (None: the
    default budget): the static pass's largest span of a tensor of three models; or the largest layer of one
    model in float32, or one model's head (a block of its rows, see :mod:`resumerge.forward.compared.heads`) and one
    batch's log-probabilities, beside every model's hidden states (twice: in and out). Returns the budget, what
    the forward pass's steps reserve (``layer``, ``heads``), and whether the static pass is folded into the
    layers' reads (where ``can_fold`` and the budget holds two layers at once: the base's, kept, and another's;
    see :mod:`.folded`). The figures are :func:`~resumerge.forward.compared.needs.step_bytes`'s (``sizes``, found here
    where not given)."""
    sizes = sizes if sizes is not None else step_bytes(streams, tokens)
    held = settled_held("check", [str(s.reader.directory) for s in streams], tokens)  # what every start names
    states = 2 * len(streams) * sizes.states
    heads, layer, static = max(sizes.heads), max(sizes.layers), sizes.static
    if can_fold:
        try:
            # the base's decoder layer kept beside another's; the embeddings' step holds one model's alone
            two = max(layer, 2 * max(sizes.decoder))
            folded = max(states + max(two, heads), static)
            return budget_fitting("the check", folded, max_memory, SystemProbe(), held=held), {
                "layer": two, "heads": heads}, True
        except UsageError:  # one layer at a time fits: the static pass reads the layers again, as it did
            pass
    peak = max(states + max(layer, heads), static)
    return (budget_fitting("the check", peak, max_memory, SystemProbe(), held=held),
            {"layer": layer, "heads": heads}, False)


def _report(models: list[Checked], static: StaticFigures, figures: PassFigures | None,
            tokens: list[list[int]], vocab: SharedVocab | None = None) -> CheckReport:
    roles, paths = [m.role for m in models], [m.path for m in models]
    vocab_size = model_rows(models[0].opened.config)
    verdict, reasons, layer = judge(roles, paths, static, figures, vocab_size)
    entries = []
    for i, m in enumerate(models):
        if figures is None:
            entries.append(ModelFigures(role=m.role, path=m.path, own=m.own))
            continue
        entries.append(ModelFigures(role=m.role, path=m.path, own=m.own, nll=figures.nll[i], kl=figures.kl[i],
                                    kl_p95=figures.kl_p95[i], top1=figures.top1[i], base_kl=figures.base_kl[i],
                                    drift=tuple(figures.drift[i]) if i else (),
                                    depart=tuple(figures.depart[i]) if i else ()))
    return CheckReport(verdict=verdict, reasons=tuple(reasons), broken_layer=layer, models=tuple(entries),
                       static=static, sequences=len(tokens), tokens=sum(len(t) - 1 for t in tokens),
                       thresholds=dict(THRESHOLDS), spread=tuple(figures.spread) if figures else (),
                       compared=compared_line(roles, vocab_size),
                       shared_tokens=len(vocab.shared) if vocab is not None else None,
                       vocabulary=vocab.describe([m.role for m in models]) if vocab is not None else None)


def compared_line(roles: list[str], vocab: int | None) -> str:
    """What the merge was compared with, in one line: with no base and no parent, that nothing was, and what
    was judged without them."""
    parents = roles.count("parent")
    named = (["its base"] if "base" in roles else []) + ([f"{parents} parent(s)"] if parents else [])
    if named:
        return "the merge with " + " and ".join(named)
    uniform = (f" and its NLL (against {THRESHOLDS['uniform_factor']} × ln {vocab:,}, the uniform guess's)"
               if vocab else "")
    return ("nothing: no base or parent was given or recorded, so only the merge's own tensors (NaN, Inf)"
            f"{uniform} were judged; KL, drift, the layer that departs and `no effect` need --base or --parent")
