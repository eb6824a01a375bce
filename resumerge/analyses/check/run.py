"""A check from start to end: find the models, the static pass, the token sequences, the forward pass under the
memory budget (journaled under the state dir, ``checks/<key>``), the verdict; a finished check's report is kept
there too, so asking again answers at once with the same report."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.check.card import run_state, update_card
from resumerge.analyses.check.chart import write_drift_chart
from resumerge.analyses.check.folded import FoldedStatic
from resumerge.analyses.check.models import Checked, find_models
from resumerge.analyses.check.needs import StepBytes, settled_held, step_bytes
from resumerge.analyses.check.passes import (
    BATCH_TOKENS,
    LAYER_PREFIX,
    PassFigures,
    forward_pass,
    run_pass,
    streams_of,
)
from resumerge.analyses.check.progress import PROGRESS_NAME, Progress, Watcher
from resumerge.analyses.check.report import CheckReport, ModelFigures, StaticFigures
from resumerge.analyses.check.static import TensorResult, logical_shapes, static_pass, tensor_results
from resumerge.analyses.check.strict import finite
from resumerge.analyses.check.tokens import Texts, cached_sequences
from resumerge.analyses.check.verdict import THRESHOLDS, judge
from resumerge.analyses.check.vocabs import SharedVocab, model_rows
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir, is_default_state_root
from resumerge.errors import InterruptedMerge, PlanChangedError, UsageError
from resumerge.forward.admission import Admission
from resumerge.forward.device import HOST, PassDevice
from resumerge.forward.folder import pass_lock
from resumerge.forward.hubreads import PassReads
from resumerge.forward.journal import Journal
from resumerge.forward.opened import layer_of
from resumerge.forward.proof import RECORDS_NAME, Depends, PassProof, compared_reads, everything, layers_through
from resumerge.forward.requires import Needs, require_transformers
from resumerge.forward.stream import ModelStream
from resumerge.forward.texts import describe
from resumerge.memory import SystemProbe, budget_fitting
from resumerge.memory.allocator import malloc_trim, tune_allocator
from resumerge.store.durable import write_file_atomic
from resumerge.torch_import import load as load_torch

if TYPE_CHECKING:  # the Ray placements: imported with --executor ray only
    from resumerge.analyses.onray import Place

REPORT_NAME = "report.json"
CHART_NAME = "drift.png"
STATIC_NAME = "static.json"
OUTSIDE_NAME = "static-outside.json"  # the static figures of the tensors outside the decoder layers (folding)
# A check on Ray: the cluster's address (None: RAY_ADDRESS, else a Ray started here) and how long the kept workers
# hosting its actors wait idle once it ends (0: fresh actors).
OnRay = tuple[str | None, float]


def run_check(model: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
              parents: Sequence[str | os.PathLike[str]] = (), prompts: str | os.PathLike[str] | None = None,
              max_memory: int | None = None, state: StateDir, on_ray: bool = False,
              ray_address: str | None = None, cut_texts: bool = False, watcher: Watcher | None = None,
              device: PassDevice = HOST, ray_keep: float = 0.0) -> CheckReport:
    """Check ``model`` against its base and parents (given, or from its record) and return the report; its
    journal is kept under ``state``. ``on_ray``: each model's forward pass on a node of the Ray cluster at
    ``ray_address`` (:mod:`.onray`; None: ``RAY_ADDRESS``, else a Ray started here), with the same report.
    ``cut_texts``: a text longer than the models' context is cut to it rather than refused (exit 2). Where the
    models' vocabularies differ they are compared over the tokens they share, decided before any layer runs
    (:mod:`.vocabs`). ``watcher`` is told each step (:class:`~resumerge.analyses.check.progress.Step`). Ctrl-C raises
    :class:`~resumerge.errors.InterruptedMerge` naming the layer reached and the command that continues.
    ``device``: where the layers and heads run (a GPU: each layer moved there while it runs, each step admitted by
    the GPU's budget too; :mod:`resumerge.forward.device`). ``ray_keep``: the seconds the kept workers hosting the
    actors on Ray wait idle once the check ends (:func:`~resumerge.analyses.onray.kept_hosts`; 0: fresh actors)."""
    if on_ray and device.on_gpu:
        raise UsageError(f"--device {device.name} runs the check's layers on this machine's GPU, and --executor ray "
                         "runs each model on a node of the cluster", hint="leave out one of the two")
    if on_ray:  # before anything is read: without Ray, one line and exit 2
        from resumerge.engine.cluster.connect import check_ray

        check_ray()
    with _passive_threads():
        return _checked(model, base, parents, prompts, max_memory, state, on_ray, (ray_address, ray_keep),
                        cut_texts, watcher, device)


def _checked(model: str | os.PathLike[str], base: str | os.PathLike[str] | None,
             parents: Sequence[str | os.PathLike[str]], prompts: str | os.PathLike[str] | None,
             max_memory: int | None, state: StateDir, on_ray: bool, ray: OnRay, cut_texts: bool,
             watcher: Watcher | None, device: PassDevice) -> CheckReport:
    """:func:`run_check`'s work, its OpenMP setting in force."""
    models = find_models(model, base, tuple(parents), state)
    _comparable(models)
    # imported only where needed: the tokenizer, a family .native does not build
    require_transformers(Needs("resumerge check"), load=False)
    prompts_file = Path(prompts) if prompts is not None else None
    # A first check loads its tokenizer (torch and transformers imported: seconds of one core): its models' bytes
    # are hashed meanwhile, on the other cores, outside the GIL. A repeated check has its tokens kept: nothing read.
    proof = PassProof(models, compared_reads(models))
    try:
        texts = cached_sequences([m.opened.directory for m in models], prompts_file, state.checks_dir,
                                 configs=[m.opened.config for m in models], paths=[m.path for m in models],
                                 cut=cut_texts, on_miss=proof.start)
        return _keyed(model, base, parents, prompts, max_memory, state, on_ray, ray, cut_texts, watcher,
                      models, texts, prompts_file, proof, device)
    finally:
        proof.close()


def _keyed(model: str | os.PathLike[str], base: str | os.PathLike[str] | None,
           parents: Sequence[str | os.PathLike[str]], prompts: str | os.PathLike[str] | None,
           max_memory: int | None, state: StateDir, on_ray: bool, ray: OnRay, cut_texts: bool,
           watcher: Watcher | None, models: list[Checked], texts: Texts, prompts_file: Path | None,
           proof: PassProof, device: PassDevice) -> CheckReport:
    """The check, its texts known: its folder found by its key and locked."""
    tokens, vocab = texts.tokens, texts.vocab
    workdir = state.checks_dir / _key(models, tokens, vocab)
    command = check_command(model, base, tuple(parents), prompts, state, cut_texts, device)
    # One process per check: two at once would delete each other's layer and head files (issue 70).
    lock = pass_lock(workdir, f"this check of {model}", command,
                     hint="wait for it to finish (asked again, the check then answers at once), or stop it (it "
                          "resumes at the layer it reached)")
    lock.acquire()
    try:
        return _locked(model, models, tokens, vocab, workdir, prompts_file, max_memory, state, on_ray, ray,
                       watcher, command, proof, device)
    except KeyboardInterrupt:  # Ctrl-C: where it stopped, and the command that continues it
        raise InterruptedMerge(stopped_at(model, workdir), resume_command=command) from None
    finally:
        lock.release()


def stopped_at(model: str | os.PathLike[str], workdir: Path) -> str:
    """Where the interrupted check of ``model`` in ``workdir`` stopped, in words: the layer it was running (from
    its progress file) and the layers its journal holds."""
    from resumerge.forward.journal import latest

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


def check_command(model: str | os.PathLike[str], base: str | os.PathLike[str] | None,
                  parents: Sequence[str | os.PathLike[str]], prompts: str | os.PathLike[str] | None,
                  state: StateDir, cut_texts: bool = False, device: PassDevice = HOST) -> str:
    """The shell command of this check (what a second one names, and what continues an interrupted one: on the
    device it ran on, though its journal resumes on any)."""
    words = ["resumerge", "check", os.fspath(model)]
    if base is not None:
        words += ["--base", os.fspath(base)]
    for parent in parents:
        words += ["--parent", os.fspath(parent)]
    if prompts is not None:
        words += ["--prompts", os.fspath(prompts)]
    if cut_texts:
        words.append("--truncate-texts")
    if device.on_gpu:
        words += ["--device", device.name]
    if device.max_gpu_memory is not None:
        words += ["--max-gpu-memory", str(device.max_gpu_memory)]
    if not is_default_state_root(state.given):
        words += ["--state-dir", os.fspath(state.root)]
    return shlex.join(words)


def _locked(model: str | os.PathLike[str], models: list[Checked], tokens: list[list[int]],
            vocab: SharedVocab | None, workdir: Path,
            prompts_file: Path | None, max_memory: int | None, state: StateDir, on_ray: bool,
            ray: OnRay, watcher: Watcher | None, command: str, proof: PassProof,
            device: PassDevice) -> CheckReport:
    """The check in ``workdir``, its lock held: answered from its report, or run (resuming its journal); ``proof``
    proves its models' bytes (its records kept in ``workdir``); ``device``: where its layers run."""
    done = workdir / REPORT_NAME
    proof.records = workdir / RECORDS_NAME
    said: str | None = None
    if done.is_file():  # asked again: the same report, and the card brought up to date with it
        try:
            proved = proof.prove(everything, refuse="its report is of those bytes", hint="")
        except PlanChangedError as exc:  # a report of bytes a model no longer holds: checked again, from the start
            _start_over(workdir, proof)
            said = f"{exc.path} changed since its last check (in a range the check reads): checked again"
        else:
            proof.record()  # the new look of a file touched, its bytes the same
            report = replace(CheckReport.from_json(json.loads(done.read_text())), prompts=describe(prompts_file),
                             proof=proved.line())
            return replace(report, card=update_card(model, state, report))
    else:
        # The pass imports torch (1-2 s of one core): now, while the proof's threads hash the models' bytes outside
        # the GIL, not after its wait (a first check's tokenizer, read without transformers, no longer covers it).
        load_torch()
        # A resumed check: what its journal holds was computed from the bytes the models held then.
        said = proof.prove(_journal_depends(workdir), refuse="the check's journal holds figures computed from the "
                           "bytes it held then", hint=f"restore the file as it was and check again (it resumes), "
                           f"or delete {workdir} to check the file as it is now from the start").line()
    proof.record()  # before the first journal file: whatever the check journals, its bytes are recorded
    reads = PassReads(workdir)  # a hub model's ranges checked (journaled in workdir), its files verified whole
    models = reads.bind(models, fresh=not _journaled(workdir), again=not on_ray)  # on Ray, read once here
    streams = streams_of(models, device.name)
    progress = Progress(workdir, model, streams[0].layers, len(models), watcher, sum(len(t) - 1 for t in tokens),
                        command)
    restore_allocator = tune_allocator()  # freed layers go back to the OS: RSS follows what is held
    error: BaseException | None = None
    try:
        sizes = step_bytes(streams, tokens)
        budget, steps, can_fold = _fits(streams, tokens, max_memory, not on_ray, sizes)  # before any weight is read
        gpu = device.budget("the check", steps, 2 * len(streams) * sizes.states)  # and the GPU's, on one
        placed = _ray_places(ray[0], sizes) if on_ray else []  # the cluster joined: can it hold the actors?
        _give_back()  # what the imports, the tokenizer and the modules' construction left free
        static, fold, outside = _static_before(models, workdir, progress, can_fold, whole=on_ray)
        figures = None
        if static is None or not static.nonfinite:  # broken already: a forward over NaNs tells nothing more

            trimmed = [-1]  # the layer whose first model's step handed the heap's free pages back

            def on_model(layer: int, m: int) -> None:
                if trimmed[0] != layer:
                    trimmed[0] = layer
                    _give_back()
                progress.say(phase="forward", layer=layer, model_index=m, model_role=models[m].role,
                             model_path=models[m].path)

            if on_ray:
                figures = _on_ray(models, streams[0].layers, tokens, workdir, progress, placed, reads, state, vocab,
                                  ray[1])
            else:
                # Each layer and each pair of heads is admitted by the RAM governor, as the merge's tensors are: it
                # sees the process's RSS, gives freed memory back when a step would not fit, and refuses (exit 2)
                # rather than pass the budget.
                def before(what: str, step: str) -> None:
                    if step == "heads":
                        progress.say(phase="heads", layer=None, model_index=None, model_role=None,
                                     model_path=None)
                        _give_back()

                with Admission(budget, steps, before, gpu) as reserve:
                    figures = forward_pass(models, streams, tokens, workdir, on_model, reserve, fold, vocab)
        if static is None:  # the layers' figures found as they were read; what they did not read, read now
            assert fold is not None
            static = _static(models, workdir, progress, {**outside, **fold.found})
            if static.nonfinite:  # as when the static pass finds it first: no forward figures
                figures = None
        reads.finish()  # each file read whole was verified as its last byte came: before the report is written
    except BaseException as exc:
        error = exc
        raise
    finally:
        for stream in streams:
            stream.close()
        if restore_allocator is not None:
            restore_allocator()
        # the kept ranges stay for a resume; where a file failed its check, the journal goes: checked again, the
        # check starts over
        reads.close(clear=False, error=error)
    report = replace(_report(models, static, figures, tokens, vocab), prompts=describe(prompts_file), proof=said)
    workdir.mkdir(parents=True, exist_ok=True)
    if figures is not None and len(models) > 1:  # people would rather look than read
        chart = write_drift_chart(workdir / CHART_NAME, report)
        report = replace(report, chart=os.path.abspath(chart))
    write_file_atomic(done, (json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False)
                             + "\n").encode())  # strict JSON: any language's parser reads it
    reads.close()  # the ranges kept for a second read go
    progress.say(phase="done", verdict=report.verdict, exit_code=report.exit_code, broken_layer=report.broken_layer)
    _record(model, state, report, done)
    Journal(workdir, LAYER_PREFIX).clear()
    return replace(report, card=update_card(model, state, report))


def _ray_places(address: str | None, sizes: StepBytes) -> list[Place]:
    """Where each model's actor runs on the Ray cluster at ``address`` and what it declares (:mod:`.onray`);
    refuses (exit 2) a cluster none of whose nodes holds an actor."""
    from resumerge.analyses.check.onray import actor_bytes
    from resumerge.analyses.onray import ray_places

    return ray_places(address, actor_bytes(sizes))


def _on_ray(models: list[Checked], layers: int, tokens: list[list[int]], workdir: Path, progress: Progress,
            placed: list[Place], reads: PassReads, state: StateDir, vocab: SharedVocab | None = None,
            keep: float = 0.0) -> PassFigures | None:
    """The forward pass with each model on a Ray node of its own (:mod:`.onray`), where ``placed`` says, journaled
    here as locally; ``status`` shows the node of each model. What the nodes read of hub files is held to
    ``reads``' journal."""
    from resumerge.analyses.check.onray import ray_models

    def on_layer(layer: int, nodes: list[str]) -> None:
        progress.say(phase="forward", layer=layer, model_index=None, model_role=None, model_path=None, nodes=nodes,
                     roles=[m.role for m in models])

    def on_reads(m: int, found: list[tuple[str, int, int, str]]) -> None:
        reads.elsewhere(models[m], found)

    given = None if state.given is None else str(state.root)  # what a node opens a model under: --state-dir
    with ray_models(models, placed, layers, on_layer, on_reads, vocab, given, keep=keep) as running:
        return run_pass([m.role for m in models], running, tokens, workdir)


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
    from resumerge.forward.journal import latest

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
    for its next row chunk (:mod:`resumerge.memory.allocator`); the check's steps leave their small temporaries
    there, and without this its peak RSS varied by 50-200 MB from one run of the same check to the next
    (bench/RESULTS.md, issue 57)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


@contextmanager
def _passive_threads() -> Iterator[None]:
    """Have torch's OpenMP threads sleep, not spin, between kernels (``OMP_WAIT_POLICY=PASSIVE``, unless set),
    when torch is not imported yet (the CLI's process; read once, as OpenMP starts); the variable is put back as
    it was when the check returns, so the process's environment is left unchanged.

    A check's kernels are small (one layer over a few hundred positions) and many; spinning threads that share
    their cores with other work hold the CPU their peers need: on the shared 2-core bench machine (load 6-10) the
    forward pass of three SmolLM2-135M models took 37.6 s with two spinning threads, 9.7 s with two sleeping ones
    and 7.2 s with one (bench/RESULTS.md, session 28)."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _record(model: str | os.PathLike[str], state: StateDir, report: CheckReport,
            where: Path) -> None:
    """A ``check`` event in the ledger of ``model`` when it is a resumerge output whose ledger the check finds
    (:func:`~resumerge.analyses.check.card.run_state`): its verdict, exit code, the layer named, each model's NLL and
    KL, and where the report is; the merge's own record then says how it was checked. A model without one (any other
    folder) has no record to add to."""
    from resumerge.errors import LedgerError, StorageError
    from resumerge.store.ledger import Ledger

    if is_hub_target(model) and ".gguf" in os.fspath(model):
        return  # a GGUF file of a hub repo: never a resumerge output (an hf:// OUT is a repo)
    run = run_state(model, state)  # the run's own ledger: where the card's section is recorded too
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


def _comparable(models: list[Checked]) -> None:
    """Every model must have the merge's layer count and width: the pass compares them layer by layer."""
    def shape(m: Checked) -> tuple[object, object]:
        c = m.opened.config
        # Nemotron-H as transformers 5.24 saves it states its layers as a list, with no count
        stated = len(c["layers_block_type"]) if isinstance(c.get("layers_block_type"), list) else None
        return (c.get("num_hidden_layers", c.get("n_layer", stated)), c.get("hidden_size", c.get("n_embd")))

    for other in models[1:]:
        if shape(other) != shape(models[0]):
            raise UsageError(f"{other.path} has {shape(other)[0]} layers of width {shape(other)[1]}, the merge "
                             f"{models[0].path} {shape(models[0])[0]} of width {shape(models[0])[1]}: a check "
                             "compares models of one shape", hint=f"check the merge against its own {other.role}")


def _key(models: list[Checked], tokens: list[list[int]], vocab: SharedVocab | None = None) -> str:
    """The content key of a check: each model's role, folder and weight files' identities, the tokens, how the
    models' vocabularies meet (a resumed check compares as the one it resumes), and the versions of the code that
    computes it."""
    # The installed versions as their distributions record them: torch's own import (2.5 s) is not needed to
    # answer a repeated check from its report (issue 70).
    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge", "torch")]
    doc = [[m.role, m.path if is_hub_target(m.path) else os.path.abspath(m.path), m.weight,
            [[f.name, f.size, f.identity] for f in m.opened.files]] for m in models]
    layout = {"batch_tokens": BATCH_TOKENS}  # the journal's hidden states are per batch of this size
    parts: list[object] = [doc, tokens, versions, THRESHOLDS, layout]
    if vocab is not None:  # absent where the vocabularies are one: the keys of such checks are as they were
        parts.append(vocab.digest())
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _fits(streams: list[ModelStream], tokens: list[list[int]], max_memory: int | None, can_fold: bool = True,
          sizes: StepBytes | None = None) -> tuple[int, dict[str, int], bool]:
    """Refuse (exit 2, before a weight is read) a check whose peak would not fit ``max_memory`` (None: the
    default budget): the static pass's largest span of a tensor of three models; or the largest layer of one
    model in float32, or one model's head (a block of its rows, see :mod:`resumerge.analyses.check.heads`) and one
    batch's log-probabilities, beside every model's hidden states (twice: in and out). Returns the budget, what
    the forward pass's steps reserve (``layer``, ``heads``), and whether the static pass is folded into the
    layers' reads (where ``can_fold`` and the budget holds two layers at once: the base's, kept, and another's;
    see :mod:`.folded`). The figures are :func:`~resumerge.analyses.check.needs.step_bytes`'s (``sizes``, found here
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
