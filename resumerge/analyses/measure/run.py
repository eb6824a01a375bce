"""``resumerge measure``: the Gram matrices of every linear's input, for every model of a merge config, over
calibration texts, for a data-aware merge (``regmean``).

Every check comes first (the config, each model a local folder of a dense family, OUT_DIR free or holding this very
measurement, the memory budget); then each model runs on the forward engine one decoder layer at a time
(:mod:`resumerge.analyses.measure.grams`), its Grams written per layer and its hidden states journaled under OUT_DIR, so
a killed measurement run again resumes at the layer it reached and ends with the same bytes. ``measure.json`` (see
:mod:`resumerge.inputs.grams`), with each file's sha256, is written last: a folder without it is unfinished.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.measure.status import LOCK_FILE, RUN_FILE
from resumerge.config.merge_config import MergeConfig, load_config_text, read_config_file
from resumerge.config.modelref import ModelRef
from resumerge.errors import ConfigError, UsageError
from resumerge.inputs.grams import (
    LAYER_PREFIX,
    MANIFEST,
    METADATA_KEY,
    GramRef,
    MeasuredModel,
    Measurement,
    layer_file,
    model_folder,
    read_measurement,
    sha256_of,
)
from resumerge.inputs.model import ModelInput, open_model
from resumerge.inputs.safetensors_format import read_header
from resumerge.store.runlock import JobLock

if TYPE_CHECKING:
    from resumerge.torch_import import torch

JOURNAL = ".journal"
RATIO_KEY = "reduce_non_diagonal_ratio"
# Keys of config.json that make a model a mixture of experts: its expert linears are not measured yet.
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


def measure_grams(config: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  texts: str | os.PathLike[str] | None = None, max_memory: int | None = None,
                  on_progress: Callable[[str], None] | None = None, cut_texts: bool = False) -> MeasureReport:
    """Measure the Grams of every model of ``config`` into ``out`` (see the module docstring); raises
    :class:`~resumerge.errors.InputError` subclasses (exit 2) before anything is written: a text longer than the
    models' context among them, unless ``cut_texts`` cuts it (the rule of ``check``:
    :func:`~resumerge.analyses.check.prompts.bounded`)."""
    merge, models, keys, tokens = _opened(config, texts, cut_texts)
    merged = _merged_pass(merge)
    folder = Path(out)
    key = _key(models, keys, tokens, merged)
    if _claimed(folder, key) and (folder / MANIFEST).is_file():
        found = read_measurement(folder, yaml_path="OUT_DIR")
        return MeasureReport(str(folder), tuple(m.key for m in found.models), _count(found),
                             sum(len(t) for t in tokens), reused=True)
    layers = _all_fit(models, keys, tokens, max_memory)
    # One process per measurement: two at once would write and delete each other's layer files (issue 70).
    command = ["resumerge", "measure", os.fspath(config), os.fspath(folder)]
    lock = JobLock(folder / LOCK_FILE, f"a measurement into {folder}",
                   shlex.join(command + (["--texts", os.fspath(texts)] if texts is not None else [])),
                   hint="wait for it to finish, or stop it (run again, it resumes at the layer it reached)")
    with lock:
        _claimed(folder, key)  # what another process claimed while this one was getting ready
        _claim(folder, key, {"config": os.path.abspath(config), "models": keys, "layers": layers,
                             "texts": os.path.abspath(texts) if texts is not None else None})
        return _run(models, keys, tokens, folder, on_progress, merged)


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
        from resumerge.memory import format_size

        found = [f"model {key}: {layers} decoder layer(s), its pass at most {format_size(peak)} beyond this "
                 f"process's {format_size(self.held)}" for key, layers, peak in self.models]
        found.append(f"tokens: {self.tokens} per model; memory: the smallest budget that fits is "
                     f"{format_size(self.smallest)}, the budget is {format_size(self.budget)} ({self.source})")
        found.append("fits" if self.fits else f"will not fit: rerun with --max-memory "
                     f"{format_size(self.smallest, compact=True)} or more")
        return found


def estimate_measure(config: str | os.PathLike[str], *, texts: str | os.PathLike[str] | None = None,
                     max_memory: int | None = None) -> MeasureEstimate:
    """What measuring ``config``'s models over ``texts`` needs under ``max_memory`` (None: the default budget):
    the checks :func:`measure_grams` makes first, and each pass's peak as it refuses one by; writes nothing."""
    from resumerge.memory import SystemProbe, default_budget, pass_budget

    _, models, keys, tokens = _opened(config, texts)
    found = _passes(models, keys, tokens)
    probe = SystemProbe()
    held = _held(models, tokens)
    budget = max_memory if max_memory is not None else default_budget(probe)
    smallest = pass_budget(max(peak for _, _, peak in found), held)  # the figure measure's refusal names
    return MeasureEstimate(tuple(found), sum(len(t) for t in tokens), held, budget,
                           "--max-memory" if max_memory is not None else "default", smallest)


def _opened(config: str | os.PathLike[str], texts: str | os.PathLike[str] | None, cut_texts: bool = False
            ) -> tuple[MergeConfig, list[ModelInput], list[str], list[list[int]]]:
    """The config, its models opened (headers only), their keys and the texts' tokens, each within the models'
    context (cut to it where ``cut_texts``): every check before a weight is read."""
    from resumerge.analyses.check.prompts import context_of, load_tokenizer, sequences
    from resumerge.forward.stream import import_transformers

    merge = load_config_text(read_config_file(config), source=os.fspath(config))
    refs = merge.referenced_models()
    if not refs:
        raise UsageError(f"{os.fspath(config)} names no model to measure")
    models = [_open(ref) for ref in refs]
    keys = [ref.key for ref in refs]
    import_transformers("resumerge measure")
    tokenizer = load_tokenizer([m.directory for m in models], what="resumerge measure")
    context = context_of([(key, m.config) for key, m in zip(keys, models)], cut_texts)
    tokens = sequences(tokenizer, Path(texts) if texts is not None else None, context, option="--texts")
    return merge, models, keys, tokens


def _merged_pass(merge: MergeConfig) -> dict[str, object] | None:
    """For a ``regmean_plus`` config, what its merged pass merges each layer with (its off-diagonal ratio): the
    Grams of RegMean++ come from the merged model's earlier layers; None for any other config."""
    from resumerge.methods.regmean import RATIO, SPEC_PLUS

    if merge.merge_method != SPEC_PLUS.name:
        return None
    ratio = merge.parameters.get(RATIO, 0.5)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(f"{RATIO} must be one number from 0 to 1 for measure's merged pass, not {ratio!r}",
                          yaml_path=f"parameters.{RATIO}")
    return {"method": SPEC_PLUS.name, RATIO: float(ratio)}


def _layer_merge(ratio: float) -> Callable[[str, list[torch.Tensor], list[torch.Tensor] | None], torch.Tensor]:
    """How the merged pass merges a layer's weight: ``regmean``'s solve where it has Grams, else the mean; float32."""
    from resumerge.methods.regmean import mean, regmean_solve
    from resumerge.torch_import import torch

    def merge(name: str, values: list[torch.Tensor], grams: list[torch.Tensor] | None) -> torch.Tensor:
        if grams is None:
            return mean(values).to(torch.float32)
        solved, _ = regmean_solve(values, grams, ratio)
        return solved.to(torch.float32)

    return merge


def _run(models: list[ModelInput], keys: list[str], tokens: list[list[int]], folder: Path,
         on_progress: Callable[[str], None] | None, merged: dict[str, object] | None) -> MeasureReport:
    from resumerge.analyses.measure.grams import measure_model
    from resumerge.forward import Weights
    from resumerge.forward.stream import ModelStream
    from resumerge.memory.allocator import tune_allocator
    from resumerge.store.durable import write_file_atomic
    from resumerge.store.killpoints import reach
    from resumerge.torch_import import torch

    batches = [(torch.tensor([list(s)]), torch.ones(1, len(s), dtype=torch.long)) for s in tokens]
    restore = tune_allocator()
    measured = []
    try:
        if merged is not None:
            ratio = merged[RATIO_KEY]
            assert isinstance(ratio, float)
            measured = _run_merged(models, keys, batches, folder, on_progress, ratio)
        for index, model in enumerate(models if merged is None else ()):
            with ModelStream(Weights.of(model.directory, model.tensors), model.config, torch.float32,
                             what="resumerge measure", key=keys[index]) as stream:

                def on_layer(layer: int, index: int = index, layers: int = stream.layers) -> None:
                    if on_progress is not None:
                        on_progress(f"model {index + 1} of {len(models)}, layer {layer + 1} of {layers}")

                measure_model(stream, batches, folder, index, folder / JOURNAL / model_folder(index),
                              on_layer=on_layer, after_layer=lambda: reach("after_measure_layer"))
                measured.append(_recorded(model, keys[index], folder, index, stream.layers))
    finally:
        if restore is not None:
            restore()
    texts = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    result = Measurement(tuple(measured), len(tokens), texts, merged)
    write_file_atomic(folder / MANIFEST, (json.dumps(result.to_json(), indent=1, sort_keys=True) + "\n").encode())
    shutil.rmtree(folder / JOURNAL, ignore_errors=True)
    return MeasureReport(str(folder), tuple(m.key for m in measured), _count(result),
                         sum(len(t) for t in tokens), reused=False)


def _run_merged(models: list[ModelInput], keys: list[str], batches: list[tuple[torch.Tensor, torch.Tensor]],
                folder: Path, on_progress: Callable[[str], None] | None, ratio: float) -> list[MeasuredModel]:
    """RegMean++'s pass: every model's layer l measured on the merged model's layers before l, every model's
    stream open at once (one layer of each read at a time)."""
    from resumerge.analyses.measure.grams import measure_merged
    from resumerge.forward import Weights
    from resumerge.forward.stream import ModelStream
    from resumerge.store.killpoints import reach
    from resumerge.torch_import import torch

    streams = []
    try:
        for key, model in zip(keys, models):
            streams.append(ModelStream(Weights.of(model.directory, model.tensors), model.config, torch.float32,
                                       what="resumerge measure", key=key))
        layers = streams[0].layers
        if any(s.layers != layers for s in streams):
            raise UsageError("RegMean++ merges models of one layer count, and these differ: "
                             + ", ".join(f"{k} {s.layers}" for k, s in zip(keys, streams)))

        def on_layer(layer: int) -> None:
            if on_progress is not None:
                on_progress(f"merged pass, layer {layer + 1} of {layers} ({len(models)} models)")

        measure_merged(streams, batches, folder, folder / JOURNAL / "merged", _layer_merge(ratio),
                       on_layer=on_layer, after_layer=lambda: reach("after_measure_layer"))
    finally:
        for stream in streams:
            stream.close()
    return [_recorded(model, keys[i], folder, i, layers) for i, model in enumerate(models)]


def _recorded(model: ModelInput, key: str, folder: Path, index: int, layers: int) -> MeasuredModel:
    """The manifest's entry of the ``index``-th model: every layer file's linears and sha256."""
    grams: dict[str, GramRef] = {}
    digests: dict[str, str] = {}
    tokens = 0
    for layer in range(layers):
        name = layer_file(index, layer)
        header = read_header(folder / name)
        recorded = json.loads(header.metadata[METADATA_KEY])
        tokens = int(recorded["tokens"])
        for linear, owner in recorded["inputs"].items():
            grams[linear] = GramRef(name, owner, int(header.tensors[owner].shape[0]))
        digests[name] = sha256_of(folder / name)
    files = tuple((f.name, f.size, f.identity) for f in model.files)
    return MeasuredModel(key, str(model.directory), files, tokens, grams, digests)


def _count(measurement: Measurement) -> int:
    return sum(len(m.sha256) for m in measurement.models)


def _open(ref: ModelRef) -> ModelInput:
    """The local model ``ref`` (headers only); refuses hub ids, adapters and mixtures of experts in one line."""
    if ref.lora is not None:
        raise UsageError(f"{ref.key}: measure runs whole models, not a base+adapter reference",
                         hint="merge the adapter into its base first (resumerge run with passthrough)")
    directory = Path(ref.path)
    if not directory.is_dir():
        raise UsageError(f"{ref.path}: measure reads local model folders, and this is not one",
                         hint="download the model (huggingface-cli download) and name its folder")
    model = open_model(ref, directory=directory, copies=False)  # writes no file of the model into OUT
    moe = next((k for k in _MOE_KEYS if model.config.get(k)), None)
    if moe is not None:
        raise UsageError(f"{ref.key} is a mixture of experts ({moe}: {model.config[moe]}); measure records the "
                         "Grams of dense linears only", hint="measure and merge dense models")
    return model


def _key(models: list[ModelInput], keys: list[str], tokens: list[list[int]], merged: dict[str, object] | None
         ) -> str:
    """What makes the measurement: each model's weight files, the tokens, the code's versions."""
    import torch

    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge")] + [torch.__version__]
    files = [[k, [[f.name, f.size, f.identity] for f in m.files]] for k, m in zip(keys, models)]
    doc = [merged, files, tokens, versions]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


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
    from resumerge.store.durable import write_file_atomic

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_FILE).is_file():
        write_file_atomic(folder / RUN_FILE, (json.dumps({"key": key, **what}) + "\n").encode())


def _all_fit(models: list[ModelInput], keys: list[str], tokens: list[list[int]], max_memory: int | None
             ) -> list[int]:
    """Refuse (exit 2, before any model is read) a measurement whose largest pass (:func:`_pass_peak`, of every
    model) would not fit ``max_memory`` (None: the default budget), naming the figure ``measure --plan`` names;
    each model's decoder layer count."""
    from resumerge.memory import SystemProbe, budget_fitting

    found = _passes(models, keys, tokens)
    largest = max(range(len(found)), key=lambda i: found[i][2])
    probe = SystemProbe()
    budget_fitting(f"measuring {models[largest].directory}", found[largest][2], max_memory, probe,
                   held=_held(models, tokens))
    return [layers for _, layers, _ in found]


def _passes(models: list[ModelInput], keys: list[str], tokens: list[list[int]]) -> list[tuple[str, int, int]]:
    """Each model's (key, decoder layers, :func:`_pass_peak`), from its headers and config."""
    from resumerge.forward import Weights
    from resumerge.forward.stream import ModelStream
    from resumerge.torch_import import torch

    found = []
    for key, model in zip(keys, models):
        with ModelStream(Weights.of(model.directory, model.tensors), model.config, torch.float32,
                         what="resumerge measure", key=key) as stream:
            found.append((key, stream.layers, _pass_peak(stream, tokens)))
    return found


def _held(models: list[ModelInput], tokens: list[list[int]]) -> int:
    """What this process holds before the pass, as ``measure --plan`` and ``measure`` of these models over these
    tokens both name it (check's :func:`~resumerge.analyses.check.needs.settled_held`)."""
    from resumerge.analyses.check.needs import settled_held

    return settled_held("measure", [str(m.directory) for m in models], tokens)


def _pass_peak(stream: object, tokens: list[list[int]]) -> int:
    """The bytes a model's pass holds at its largest step: the hidden states in and out, the largest layer in
    float32 and a layer's float64 sums (four distinct inputs, the widest squared)."""
    from resumerge.forward.reader import pass_bytes
    from resumerge.forward.stream import ModelStream

    assert isinstance(stream, ModelStream)
    config = stream.config
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    wide = max(hidden, int(getattr(config, "intermediate_size", 0) or 0))
    positions = sum(len(t) for t in tokens)
    return 2 * positions * hidden * 4 + pass_bytes(stream.formats, stream.layers, value_bytes=4) + 4 * wide * wide * 8


__all__ = ["LAYER_PREFIX", "MeasureEstimate", "MeasureReport", "estimate_measure", "measure_grams"]
