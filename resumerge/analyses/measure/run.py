"""``resumerge measure``: the Gram matrices of every linear's input, for every model of a merge config, over
calibration texts, for a data-aware merge (``regmean``).

Every check comes first (the config, each model of a dense family opened by the forward engine's one opener: a local
folder, a hub repo, a GGUF file; OUT_DIR free or holding this very measurement, the memory budget); then each model
runs on the forward engine's journaled layer pass (:mod:`.passes`, :mod:`.grams`), its Grams written per layer to
OUT_DIR and its hidden states journaled under the state dir, so a killed measurement run again resumes at the layer
it reached and ends with the same bytes. ``measure.json`` (see
:mod:`resumerge.inputs.grams`), with each file's sha256, is written last: a folder without it is unfinished.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.measure.passes import Placed, run_measurement, stream_of, workdir_of
from resumerge.analyses.measure.status import LOCK_FILE, RUN_FILE
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import MergeConfig, load_config_text, read_config_file
from resumerge.config.modelref import ModelRef
from resumerge.config.passplace import PassPlace
from resumerge.errors import ConfigError, UsageError
from resumerge.forward.engine.device import PassDevice
from resumerge.forward.job.driver import Fit, PassFolder, content_key, drive
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.job.proof import RECORDS_NAME, Depends, PassProof, everything
from resumerge.forward.opening.opened import PassModel, open_for_pass, where_of
from resumerge.forward.placing.sites import PassSite, site_of
from resumerge.inputs.grams import (
    LAYER_PREFIX,
    MANIFEST,
    Measurement,
    layer_file,
    read_measurement,
)
from resumerge.machine.threadcount import THREADS_FILE

if TYPE_CHECKING:
    from resumerge.forward.engine.device import GpuBudget
    from resumerge.inputs.grams import MeasuredModel

# Keys of config.json that make a model a mixture of experts: its experts have no Grams (their importance
# matrix is measured, --imatrix).
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MeasureReport:
    """A finished measurement: where it is, its ``models`` (their keys), the ``files`` written, the tokens run per
    model and whether it was found finished already (``reused``)."""

    out: str
    models: tuple[str, ...]
    files: int
    tokens: int
    reused: bool
    proof: str | None = None  # what proving the models' bytes found, in one line (resumerge.forward.job.proof)
    imatrix: str | None = None  # --imatrix: where llama.cpp's importance matrix of the Grams was written
    imatrix_entries: int = 0  # and how many weights it names


def measure_grams(config: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  texts: str | os.PathLike[str] | None = None, on_progress: Callable[[str], None] | None = None,
                  cut_texts: bool = False, settings: MeasureSettings,
                  imatrix: str | os.PathLike[str] | None = None) -> MeasureReport:
    """Measure the Grams of every model of ``config`` into ``out`` (see the module docstring); raises
    :class:`~resumerge.errors.InputError` subclasses (exit 2) before anything is written: a text longer than the
    models' context among them, unless ``cut_texts`` cuts it (the rule of ``check``:
    :func:`~resumerge.forward.text.texts.bounded`). A model may be a local folder, a hub repo or a GGUF file (the pass's
    one opener: :mod:`resumerge.forward.opening.opened`); ``settings`` (:class:`MeasureSettings`): the journal is kept
    under its ``state`` (the state dir the API resolved), and each layer is admitted by the RAM governor under its
    ``max_memory`` (and, on a GPU, its ``device``'s: :mod:`resumerge.forward.engine.device`); its ``placement``: where
    the executor placed the pass
    (:mod:`resumerge.config.passplace`): here, or each model's pass in an actor of its own on a Ray cluster
    (:mod:`.onray`), the models side by side, with the same bytes (not with a GPU here: refused, exit 2).
    ``imatrix``: the Grams also written there as llama.cpp's importance matrix (:mod:`.importance`), once measured
    (or found measured)."""
    state, device = settings.state, settings.device
    site = settings.site
    site.refuse("the measurement", device.name, device.on_gpu)
    merge, models, keys, tokens = _opened(config, texts, cut_texts, state, experts=imatrix is not None)
    archs = _imatrix_archs(imatrix, out, models)
    merged = _merged_pass(merge)
    if merged is not None:
        site.refuse_away("measure", "runs each model's own pass on a node; a regmean_plus config's merged pass "
                         "merges every model's layer in one place", hint="leave out --executor ray")
    folder = Path(out)
    key = _key(models, keys, tokens, merged)
    # the bytes each model's pass reads, recorded beside its journal (which goes once it is done: so not in it)
    proof = PassProof(models, records=state.measures_dir / f"{key[:32]}.{RECORDS_NAME}")
    # One process per measurement: two at once would write and delete each other's layer files (issue 70).
    command = ["resumerge", "measure", os.fspath(config), os.fspath(folder),
               *(["--device", device.name] if device.on_gpu else [])]
    where = PassFolder(folder, f"a measurement into {folder}",
                       shlex.join(command + (["--texts", os.fspath(texts)] if texts is not None else [])),
                       hint="wait for it to finish, or stop it (run again, it resumes at the layer it reached)",
                       lock_name=LOCK_FILE, threads=state.measures_dir / key[:32] / THREADS_FILE)
    job = MeasureJob(where, os.fspath(config), None if texts is None else os.fspath(texts), key, models, keys, tokens,
                     merged, proof, settings, on_progress)
    # Measured into a folder of its own: refused (exit 2) before it is written, its lock included, where the pass
    # would not fit; a finished one answers without its fit.
    finished = _claimed(folder, key) and (folder / MANIFEST).is_file()
    report = drive(job if finished else replace(job, ahead=job.judged()))
    if imatrix is None:
        return report
    from resumerge.analyses.measure.importance import write_measured

    dataset = os.path.basename(texts) if texts is not None else "resumerge's built-in texts"
    written = write_measured(folder, read_measurement(folder, yaml_path="OUT_DIR"), archs, Path(imatrix), dataset)
    return replace(report, imatrix=os.fspath(imatrix), imatrix_entries=written)


def _imatrix_archs(imatrix: str | os.PathLike[str] | None, out: str | os.PathLike[str],
                   models: list[PassModel]) -> list[str]:
    """Each model's GGUF architecture, whose names ``--imatrix``'s entries take; refused (exit 2, before anything
    is written) for a family resumerge does not write as GGUF, a file inside OUT_DIR (which holds the Grams alone)
    or in a folder that does not exist."""
    if imatrix is None:
        return []
    from resumerge.forward.sums.imatrix import gguf_arch

    where = Path(imatrix).expanduser().resolve()
    if not where.parent.is_dir():
        raise UsageError(f"--imatrix {os.fspath(imatrix)}: no folder {where.parent} to write it in",
                         hint="name a file in an existing folder")
    if where.is_relative_to(Path(out).expanduser().resolve()):
        raise UsageError(f"--imatrix {os.fspath(imatrix)} is inside OUT_DIR, which holds the Grams alone",
                         hint="name a file outside OUT_DIR")
    return [gguf_arch(m.opened.config.get("model_type"), "--imatrix") for m in models]


@dataclass(frozen=True)
class MeasureSettings:
    """How a measurement runs (none of it in its key): under ``max_memory`` (None: the default budget), journaled
    under ``state``, its models where the executor placed them (``placement``), its layers on ``device``."""

    max_memory: int | None
    state: StateDir
    placement: PassPlace
    device: PassDevice

    @property
    def site(self) -> PassSite:
        """Where the models run, as the measurement asks it (:mod:`resumerge.forward.placing.sites`)."""
        return site_of(self.placement)


@dataclass(frozen=True)
class _Judged:
    """A measurement's fit: each model's decoder layers, the budget, what a step reserves, the hidden states the
    GPU holds, and where each model's pass runs (placed: on Ray each model's node)."""

    layers: list[int]
    budget: int
    step: int
    gpu: GpuBudget | None
    placed: Placed


@dataclass(frozen=True)
class MeasureJob:
    """A measurement as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): OUT_DIR is its folder
    (its ``measure.json`` the answer cache), each model's layer pass its steps (:mod:`.passes`), ``measure.json``
    written last. ``ahead``: its fit judged before its folder is locked (a pass writing into a folder of the
    user's writes nothing before it is judged)."""

    folder: PassFolder
    config: str
    texts: str | None
    key: str
    models: list[PassModel]
    keys: list[str]
    tokens: list[list[int]]
    merged: dict[str, object] | None
    proof: PassProof
    settings: MeasureSettings
    on_progress: Callable[[str], None] | None
    ahead: _Judged | None = None

    def answered(self) -> tuple[MeasureReport | None, str | None]:
        """The measurement OUT_DIR holds finished (its models' bytes proved the same), or None."""
        folder = self.folder.path
        if not (_claimed(folder, self.key) and (folder / MANIFEST).is_file()):
            return None, None
        said = self.proof.prove(everything, refuse=f"{os.fspath(folder)} holds the Grams of the bytes it held then",
                                hint="measure into a new folder to measure the file as it is now").line()
        self.proof.record()  # the new look of a file touched, its bytes the same
        found = read_measurement(folder, yaml_path="OUT_DIR")
        return MeasureReport(os.fspath(folder), tuple(m.key for m in found.models), _count(found),
                             sum(len(t) for t in self.tokens), reused=True, proof=said), None

    def proved(self) -> str | None:
        """The Grams written so far proved against the models' bytes (and those bytes recorded)."""
        folder = self.folder.path
        said = self.proof.prove(_grams_depend(folder, len(self.models)), refuse=f"the Grams in {os.fspath(folder)} "
                                "were measured from the bytes it held then", hint="restore the file as it was and "
                                "measure again (it resumes), or measure into a new folder").line()
        if said is not None and self.on_progress is not None:
            self.on_progress(said)
        self.proof.record()  # before the first layer's Grams: whatever the pass writes, its bytes are recorded
        return said

    def judged(self) -> _Judged:
        """The measurement's fit (refused, exit 2, before any weight is read, where it does not fit) and the GPU's,
        and where each model's pass runs (on Ray: the cluster joined and each model's actor placed, refused,
        exit 2, where it cannot hold them)."""
        from resumerge.machine.memory import SystemProbe, budget_fitting

        settings = self.settings
        passes = _passes(self.models, self.keys, self.tokens)
        site = settings.site

        def needs() -> list[int]:
            from resumerge.analyses.measure.onray import actor_bytes

            return actor_bytes([peak for _, _, peak, _ in passes])

        seats = site.seat(needs, "measurement", settings.state)
        # what this process holds at the largest step: here the largest model's pass (named as ``measure --plan``
        # names it), on Ray every model's hidden states at once
        held = seats.held([str(m.path) for m in self.models], [peak for _, _, peak, _ in passes],
                          [step for *_, step in passes])
        budget = budget_fitting(f"measuring {held.named}", held.bytes, settings.max_memory, SystemProbe(),
                                held=_held(self.models, self.tokens))
        # on a GPU: its budget too, before any read
        gpu = settings.device.budget("the measurement", {"layer": held.step}, held.states)
        layers = [n for _, n, _, _ in passes]
        return _Judged(layers, budget, held.step, gpu, Placed(site, seats, layers, settings.device.name))

    @contextmanager
    def fitted(self) -> Iterator[Fit[_Judged]]:
        """The fit judged ahead (or now), and OUT_DIR claimed for this measurement (once: a resumed one finds it)."""
        judged = self.ahead if self.ahead is not None else self.judged()
        folder = self.folder.path
        _claimed(folder, self.key)  # what another process claimed while this one was getting ready
        _claim(folder, self.key, {"config": os.path.abspath(self.config), "models": self.keys,
                                  "layers": judged.layers,
                                  "texts": os.path.abspath(self.texts) if self.texts is not None else None})
        yield Fit(judged.budget, {"layer": judged.step}, judged, judged.gpu)

    def run(self, ready: _Judged, reserve: Reserve) -> list[MeasuredModel]:
        """Every model's Grams, then ``measure.json`` (:func:`~.passes.run_measurement`)."""
        workdir = workdir_of(self.folder.path, self.settings.state.measures_dir / self.key[:32])
        _, measured = run_measurement(self.models, self.keys, self.tokens, self.folder.path, workdir,
                                      self.on_progress, self.merged, reserve, ready.placed)
        return measured

    def finish(self, found: list[MeasuredModel], proof: str | None) -> MeasureReport:
        """The measurement's report."""
        return MeasureReport(os.fspath(self.folder.path), tuple(m.key for m in found),
                             sum(len(m.sha256) for m in found), sum(len(t) for t in self.tokens), reused=False,
                             proof=proof)

    def stopped_at(self) -> str:
        """Where the measurement stopped: the Grams it wrote are kept, the pass resumes at the layer it reached."""
        written = sum(1 for _ in self.folder.path.glob(f"*/{LAYER_PREFIX}*.safetensors"))
        return (f"the measurement into {os.fspath(self.folder.path)} was interrupted ({written} layer file(s) of "
                "Grams written; run again, it resumes at the layer it reached)")


@dataclass(frozen=True)
class MeasureEstimate:
    """What a measurement of a config needs here (``resumerge measure --plan``), reading nothing but headers and
    the texts: each model's (key, decoder layers, bytes its pass holds at its largest step), the tokens each runs,
    what this process holds, the budget in force (``source``: --max-memory or the default) and the smallest budget
    that fits."""

    models: tuple[tuple[str, int, int], ...]
    tokens: int
    held: int
    budget: int
    source: str
    smallest: int

    @property
    def fits(self) -> bool:
        """Whether every model's pass fits the budget."""
        return self.smallest <= self.budget

    def lines(self) -> list[str]:
        """The estimate as ``measure --plan`` prints it."""
        from resumerge.machine.memory import format_size

        found = [f"model {key}: {layers} decoder layer(s), its pass at most {format_size(peak)} beyond this "
                 f"process's {format_size(self.held)}" for key, layers, peak in self.models]
        found.append(f"tokens: {self.tokens} per model; memory: the smallest budget that fits is "
                     f"{format_size(self.smallest)}, the budget is {format_size(self.budget)} ({self.source})")
        found.append("fits" if self.fits else f"will not fit: rerun with --max-memory "
                     f"{format_size(self.smallest, compact=True)} or more")
        return found


def estimate_measure(config: str | os.PathLike[str], *, texts: str | os.PathLike[str] | None = None,
                     max_memory: int | None = None, cut_texts: bool = False,
                     state: StateDir) -> MeasureEstimate:
    """What measuring ``config``'s models over ``texts`` (cut to the context where ``cut_texts``) needs under
    ``max_memory`` (None: the default budget): the checks :func:`measure_grams` makes first, and each pass's peak
    as it refuses one by; writes nothing (a hub or GGUF model's small files aside, under ``state``, the state dir
    the API resolved)."""
    from resumerge.machine.memory import SystemProbe, default_budget, pass_budget

    _, models, keys, tokens = _opened(config, texts, cut_texts, state)
    found = [(key, layers, peak) for key, layers, peak, _ in _passes(models, keys, tokens)]
    probe = SystemProbe()
    held = _held(models, tokens)
    budget = max_memory if max_memory is not None else default_budget(probe)
    smallest = pass_budget(max(peak for _, _, peak in found), held)  # the figure measure's refusal names
    return MeasureEstimate(tuple(found), sum(len(t) for t in tokens), held, budget,
                           "--max-memory" if max_memory is not None else "default", smallest)


def _opened(config: str | os.PathLike[str], texts: str | os.PathLike[str] | None, cut_texts: bool,
            state: StateDir, *, experts: bool = False
            ) -> tuple[MergeConfig, list[PassModel], list[str], list[list[int]]]:
    """The config, its models opened (headers only), their keys and the texts' tokens, each within the models'
    context (cut to it where ``cut_texts``): every check before a weight is read. ``experts``: mixtures of
    experts taken (``--imatrix``: their experts' importance is measured, not their Grams)."""
    from resumerge.forward.engine.requires import Needs, require_transformers
    from resumerge.forward.text.texts import context_of, load_tokenizer, sequences

    merge = load_config_text(read_config_file(config), source=os.fspath(config))
    refs = merge.referenced_models()
    if not refs:
        raise UsageError(f"{os.fspath(config)} names no model to measure")
    models = [_open(ref, state, experts) for ref in refs]
    keys = [ref.key for ref in refs]
    # transformers found, not imported: a tokenizer it would load unchanged is read without it (.plaintok: the
    # same ids, seconds of a first measure's start), and a family .native builds never imports it.
    require_transformers(Needs("resumerge measure"), load=False)
    tokenizer = load_tokenizer([m.opened.directory for m in models], what="resumerge measure", plain=True)
    context = context_of([(key, m.opened.config) for key, m in zip(keys, models)], cut_texts)
    tokens = sequences(tokenizer, Path(texts) if texts is not None else None, context, option="--texts")
    return merge, models, keys, tokens


def _merged_pass(merge: MergeConfig) -> dict[str, object] | None:
    """For a ``regmean_plus`` config, what its merged pass merges each layer with (its off-diagonal ratio): the
    Grams of RegMean++ come from the merged model's earlier layers; None for any other config."""
    from resumerge.merge.methods.regmean import RATIO, SPEC_PLUS

    if merge.merge_method != SPEC_PLUS.name:
        return None
    ratio = merge.parameters.get(RATIO, 0.5)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(f"{RATIO} must be one number from 0 to 1 for measure's merged pass, not {ratio!r}",
                          yaml_path=f"parameters.{RATIO}")
    return {"method": SPEC_PLUS.name, RATIO: float(ratio)}


def _grams_depend(folder: Path, count: int) -> Depends:
    """What of its models' bytes a measurement in ``folder`` (of ``count`` models) depends on: of each model, the
    decoder layers whose Grams are written (and the tensors outside the layers, its embeddings, once one is)."""
    from resumerge.forward.job.proof import layers_through

    written = []
    for index in range(count):
        layer = 0
        while (folder / layer_file(index, layer)).is_file():
            layer += 1
        written.append(layers_through(layer - 1 if layer else None, outside=False))
    return lambda model, group: written[model](model, group)


def _count(measurement: Measurement) -> int:
    return sum(len(m.sha256) for m in measurement.models)


def _open(ref: ModelRef, state: StateDir, experts: bool = False) -> PassModel:
    """The model ``ref`` names, opened for its pass (headers only; a local folder, a hub repo, a GGUF file:
    :func:`~resumerge.forward.opening.opened.open_for_pass`); refuses adapters, and mixtures of experts unless
    ``experts`` (``--imatrix``), in one line."""
    if ref.lora is not None:
        raise UsageError(f"{ref.key}: measure runs whole models, not a base+adapter reference",
                         hint="merge the adapter into its base first (resumerge run with passthrough)")
    model = replace(open_for_pass(where_of(ref), f"model {ref.key}", state), role="model")
    config = model.opened.config
    moe = next((k for k in _MOE_KEYS if config.get(k)), None)
    if moe is not None and not experts:
        raise UsageError(f"{ref.key} is a mixture of experts ({moe}: {config[moe]}); measure records the "
                         "Grams of dense linears only (its experts' importance matrix with --imatrix)",
                         hint="measure and merge dense models, or give --imatrix FILE for llama.cpp's matrix")
    return model


def _key(models: list[PassModel], keys: list[str], tokens: list[list[int]], merged: dict[str, object] | None
         ) -> str:
    """What makes the measurement: each model's weight files, the tokens, the code's versions."""
    import torch

    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge")] + [torch.__version__]
    files = [[k, [[f.name, f.size, f.identity] for f in m.opened.files]] for k, m in zip(keys, models)]
    doc = [merged, files, tokens, versions]
    return content_key(doc)


def _claimed(folder: Path, key: str) -> bool:
    """Whether ``folder`` holds this very measurement (finished or not); refuses one that holds anything else
    (another measurement, other files), before anything is written."""
    run = folder / RUN_FILE
    if run.is_file():
        if json.loads(run.read_text(encoding="utf-8")).get("key") != key:
            raise UsageError(f"{folder} holds a measurement of other models, texts or versions",
                             hint="measure into an empty folder, or delete this one")
        return True
    if folder.exists() and (not folder.is_dir() or any(p.name != LOCK_FILE for p in folder.iterdir())):
        raise UsageError(f"{folder} is not an empty folder: measure writes its Grams into a folder of its own",
                         hint="name a new folder")
    return False


def _claim(folder: Path, key: str, what: dict[str, object]) -> None:
    """Record in ``folder`` that it holds the measurement ``key`` of ``what`` (the config, the models and their
    layer counts, for ``status``); once: a resumed one finds it there."""
    from resumerge.machine.durable import write_file_atomic

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_FILE).is_file():
        write_file_atomic(folder / RUN_FILE, (json.dumps({"key": key, **what}) + "\n").encode())


def _passes(models: list[PassModel], keys: list[str], tokens: list[list[int]]) -> list[tuple[str, int, int, int]]:
    """Each model's (key, decoder layers, :func:`_pass_peak`, what one step of its pass reserves), from its
    headers and config."""
    found = []
    for key, model in zip(keys, models):
        with stream_of(model, key) as stream:
            found.append((key, stream.layers, _pass_peak(stream, tokens), _pass_peak(stream, tokens, states=False)))
    return found


def _held(models: list[PassModel], tokens: list[list[int]]) -> int:
    """What this process holds before the pass, as ``measure --plan`` and ``measure`` of these models over these
    tokens both name it (check's :func:`~resumerge.forward.compared.needs.settled_held`)."""
    from resumerge.forward.compared.needs import settled_held

    return settled_held("measure", [str(m.path) for m in models], tokens)


def _pass_peak(stream: object, tokens: list[list[int]], *, states: bool = True) -> int:
    """The bytes a model's pass holds at its largest step: the hidden states in and out (not with ``states``
    False: what a step of it reserves, the states being held already), the largest layer in float32 and a layer's
    float64 sums (four distinct inputs, the widest squared)."""
    from resumerge.forward.engine.reader import pass_bytes
    from resumerge.forward.engine.stream import ModelStream

    assert isinstance(stream, ModelStream)
    config = stream.config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    wide = max(hidden, int(getattr(config, "intermediate_size", 0) or 0))
    positions = sum(len(t) for t in tokens)
    held = 2 * positions * hidden * 4 if states else 0
    # a tensor the reader maps in place is counted once, not again for its read (check.needs.step_bytes's rule)
    return held + pass_bytes(stream.formats, stream.layers, value_bytes=4, in_place=stream.reader.maps) \
        + 4 * wide * wide * 8


__all__ = ["LAYER_PREFIX", "MeasureEstimate", "MeasureReport", "estimate_measure", "measure_grams"]
