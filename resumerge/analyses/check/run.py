"""A check from start to end: find the models, the static pass, the token sequences, the forward pass under the
memory budget (journaled under the state dir, ``checks/<key>``), the verdict; a finished check's report is kept
there too, so asking again answers at once with the same report."""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from resumerge.analyses.check.job import CheckJob, CheckSettings
from resumerge.analyses.check.models import Checked, find_models
from resumerge.analyses.check.progress import Watcher
from resumerge.analyses.check.report import CheckReport
from resumerge.analyses.check.verdict import THRESHOLDS
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir, is_default_state_root
from resumerge.errors import UsageError
from resumerge.forward.compared.passes import BATCH_TOKENS
from resumerge.forward.engine.device import HOST, PassDevice
from resumerge.forward.engine.requires import Needs, require_transformers
from resumerge.forward.job.driver import PassFolder, content_key, drive
from resumerge.forward.job.proof import PassProof, compared_reads
from resumerge.forward.placing.sites import site_of
from resumerge.forward.text.tokens import Texts, cached_sequences
from resumerge.forward.text.vocabs import SharedVocab


def run_check(asked: CheckAsked, settings: CheckSettings, watcher: Watcher | None = None) -> CheckReport:
    """Check ``asked.model`` against its base and parents (given, or from its record) and return the report; its
    journal is kept under ``settings.state`` (:class:`~.job.CheckSettings`: the budget, where the executor placed
    the pass, the device, where a checked merge's ledger is looked for). ``asked.cut_texts``: a text longer than
    the models' context is cut to it rather than refused (exit 2). Where the models' vocabularies differ they are
    compared over the tokens they share, decided before any layer runs (:mod:`resumerge.forward.text.vocabs`).
    ``watcher`` is told each step (:class:`~resumerge.analyses.check.progress.Step`). Ctrl-C raises
    :class:`~resumerge.errors.InterruptedMerge` naming the layer reached and the command that continues."""
    site = site_of(settings.placement)
    site.refuse("the check", settings.device.name, settings.device.on_gpu)
    site.available()  # before anything is read: without Ray (on Ray), one line and exit 2
    with _passive_threads():
        return _checked(asked, settings, watcher)


@dataclass(frozen=True)
class CheckAsked:
    """What the user asked to check, as the command line says it: the ``model``, its ``base`` and ``parents``
    (none given: from its record), the texts (``prompts``; None: the built-in ones), and whether a text past the
    context is cut (``cut_texts``; what the check's command names, :meth:`command`)."""

    model: str | os.PathLike[str]
    base: str | os.PathLike[str] | None = None
    parents: tuple[str | os.PathLike[str], ...] = ()
    prompts: str | os.PathLike[str] | None = None
    cut_texts: bool = False

    def command(self, settings: CheckSettings) -> str:
        """:func:`check_command` of this check."""
        return check_command(self.model, self.base, self.parents, self.prompts, settings.state, self.cut_texts,
                             settings.device)


def _checked(asked: CheckAsked, settings: CheckSettings, watcher: Watcher | None) -> CheckReport:
    """:func:`run_check`'s work, its OpenMP setting in force."""
    state = settings.state
    models = find_models(asked.model, asked.base, asked.parents, state)
    _comparable(models)
    # imported only where needed: the tokenizer, a family .native does not build
    require_transformers(Needs("resumerge check"), load=False)
    prompts_file = Path(asked.prompts) if asked.prompts is not None else None
    # A first check loads its tokenizer (torch and transformers imported: seconds of one core): its models' bytes
    # are hashed meanwhile, on the other cores, outside the GIL. A repeated check has its tokens kept: nothing read.
    proof = PassProof(models, compared_reads(models))
    try:
        texts = cached_sequences([m.opened.directory for m in models], prompts_file, state.checks_dir,
                                 configs=[m.opened.config for m in models], paths=[m.path for m in models],
                                 cut=asked.cut_texts, on_miss=proof.start)
        return _keyed(asked, settings, watcher, models, texts, prompts_file, proof)
    finally:
        proof.close()


def _keyed(asked: CheckAsked, settings: CheckSettings, watcher: Watcher | None, models: list[Checked], texts: Texts,
           prompts_file: Path | None, proof: PassProof) -> CheckReport:
    """The check, its texts known: its folder found by its key, and the job driven there
    (:func:`~resumerge.forward.job.driver.drive`: locked, answered from its report, or run)."""
    workdir = settings.state.checks_dir / _key(models, texts.tokens, texts.vocab)
    command = asked.command(settings)
    # One process per check: two at once would delete each other's layer and head files (issue 70).
    folder = PassFolder(workdir, f"this check of {asked.model}", command,
                        hint="wait for it to finish (asked again, the check then answers at once), or stop it (it "
                             "resumes at the layer it reached)")
    return drive(CheckJob(folder, asked.model, models, texts, prompts_file, settings, watcher, proof))


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
    parts: list[object] = [doc, tokens, versions, dict(THRESHOLDS), layout]
    if vocab is not None:  # absent where the vocabularies are one: the keys of such checks are as they were
        parts.append(vocab.digest())
    return content_key(parts)[:32]


