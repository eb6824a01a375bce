"""What a caller asks of a run, as a few frozen groups (:class:`Output`, :class:`Merging`, :class:`Resources`,
:class:`Hub`, :class:`Stages`, :class:`Lora`, :class:`Surgery`, :class:`Trackers`, :class:`Search`, :class:`Harness`),
the run's
groups held in one :class:`Settings` a notebook builds once and passes to every call, and the one
place they become :class:`~resumerge.merge.plan.merge_plan.PlanOptions` (what changes the output's bytes) and
:class:`~resumerge.config.settings.RunSettings` (what does not), with the guards every kind of run shares: OUT
named, a config given as a file or as YAML text, a recipe's OUT kept from a single merge. Each raises
:class:`~resumerge.errors.UsageError` (exit 2) for a bad value, before any work.

A group's field is named as the CLI flag's dest (``max_memory`` is ``--max-memory``): the CLI hands its parsed
flags to :func:`~resumerge.api.flagmap.grouped`, which packs them into the groups the API function takes, so a new
option is a field of its group and a flag, nothing else. A field that some function cannot honour says which
(``not_for``): that function refuses it when set (UsageError), and the CLI has no such flag there
(tests/test_front_door.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.api.ggufoptions import DEFAULT_GGUF_TYPE, TYPE_FILE, gguf_options
from resumerge.config.locations import StateDir
from resumerge.config.settings import HubOutputOptions, RunSettings
from resumerge.errors import LedgerError, OutputDirError, UsageError
from resumerge.machine.memory.sizes import parse_size
from resumerge.merge.plan.defaults import DEFAULT_SEED
from resumerge.runs.evolve.options import SearchOptions
from resumerge.runs.transplant.spec import SurgeryChoices

if TYPE_CHECKING:
    from resumerge.config.locations import RunLocations
    from resumerge.config.passplace import PassPlace
    from resumerge.merge.engine.executors import Executor
    from resumerge.merge.plan.merge_plan import PlanOptions

PathLike = str | os.PathLike[str]

# The API functions that extract a LoRA adapter (one adapter file: no shards, no tokenizer, no quantized format).
_EXTRACTION = ("extract_lora", "estimate_extraction")
_SURGERY = ("tokensurgeon", "estimate_tokensurgeon")
# The API functions that run a forward pass over models read as they are (no output written, nothing staged,
# nothing downloaded beyond what the pass's one opener reads): of the resources they honour the memory budget, and
# a pass that runs layers (not its estimate, which reads headers) where they run: the device and its GPU budget.
_PASSES = ("check", "measure", "estimate_measure", "evaluate")
# The parameter search: it merges each candidate on the device within the memory budget, nothing else of these.
_SEARCH = ("evolve",)
_ESTIMATES = ("estimate", "estimate_extraction", "estimate_measure")
# The calls that read what a run recorded (only the state dir), those that run a pass over models read as they are
# (not evaluate, which may merge a config it reads), and those that open a merge unwritten.
_READING = ("status", "recipe_status", "verify")
_PASS_CALLS = ("check", "measure", "estimate_measure")
_OPENED = ("open_unwritten", "open_population")


def _not_for(*functions: str) -> dict[str, tuple[str, ...]]:
    """A group field's metadata: the API functions that refuse it when set (a field without: every function taking
    its group honours it)."""
    return {"not_for": functions}


@dataclass(frozen=True)
class Output:
    """What OUT holds besides the weights' values: ``out_shard_size`` (bytes or ``"1GB"``; None: the planner's
    pick, about 1/100 of the output), the parent's tokenizer (``copy_tokenizer``), README.md and
    mergekit_config.yml (``write_model_card``), and ``dequantize``: every tensor stored plainly in its dtype, whatever
    format the base model is stored in. ``out_type="gguf"`` writes one GGUF file, ``model.gguf``, instead of
    safetensors shards, its matrices as ``gguf_type`` (``f16``, ``bf16``, ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``,
    ``q4_0``, or one of llama-quantize's K-quant mixes ``q2_k`` ... ``q6_k`` (``q2_k_s`` with an importance matrix
    only), IQ4 mixes ``iq4_nl``, ``iq4_xs`` or IQ3 mixes ``iq3_m``, ``iq3_s``, ``iq3_xs``, ``iq3_xxs`` (the last two
    with an importance matrix only), IQ2 and IQ1 mixes ``iq2_m`` ... ``iq2_xxs``, ``iq1_m``, ``iq1_s`` (with an
    importance matrix only), each tensor's type as llama.cpp picks it; ``gguf_tensor_types``
    ``PATTERN=TYPE`` pairs, ``gguf_output_type`` and ``gguf_token_embedding_type`` as
    llama-quantize's ``--tensor-type``, ``--output-tensor-type`` and ``--token-embedding-type``; ``imatrix``: an
    importance matrix file of llama.cpp's, GGUF or ``.dat``; or ``imatrix_texts``: a file of texts, one a line, the
    importance matrix computed on the merge itself from them before the encoding, in a forward pass over the merge
    never written; ``gguf_tensor_type_file``: a file of ``PATTERN=TYPE`` pairs, after ``gguf_tensor_types``;
    ``gguf_override_kv`` ``KEY=TYPE:VALUE`` key-values and ``gguf_pure`` as llama-quantize's ``--tensor-type-file``,
    ``--override-kv`` and ``--pure``; ``gguf_target_size`` (bytes or ``"90MB"``) or ``gguf_target_bpw``: the
    decoder layers' matrices' types chosen, by what each costs the merge on ``imatrix_texts``, for the file to be
    at most that size) and its tokenizer from a GGUF parent, or with
    ``gguf_split_max_size`` (bytes or ``"2GB"``)
    gguf-split's files ``model-00001-of-0000N.gguf`` of at most that many tensor bytes each; ``out_adapter`` writes a
    ``core_space`` merge of LoRA adapters as one merged PEFT adapter (rank at most the adapters' summed ranks)
    instead of a merged model. ``evolve`` honours ``out_type`` and ``gguf_type`` alone: how its ``--merge-best``
    is written."""

    out_shard_size: int | str | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    copy_tokenizer: bool = field(default=True, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    write_model_card: bool = field(default=True, metadata=_not_for("estimate", *_SEARCH))
    dequantize: bool = field(default=False, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    out_type: str = field(default="safetensors", metadata=_not_for(*_EXTRACTION))
    gguf_type: str = field(default=DEFAULT_GGUF_TYPE, metadata=_not_for(*_EXTRACTION))
    gguf_split_max_size: int | str | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_tensor_types: tuple[str, ...] = field(default=(), metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_output_type: str | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_token_embedding_type: str | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_tensor_type_file: PathLike | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_override_kv: tuple[str, ...] = field(default=(), metadata=_not_for(*_EXTRACTION, *_SEARCH))
    gguf_pure: bool = field(default=False, metadata=_not_for(*_EXTRACTION, *_SEARCH))
    imatrix: PathLike | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    imatrix_texts: PathLike | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    gguf_target_size: int | str | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    gguf_target_bpw: float | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH))
    out_adapter: bool = field(default=False, metadata=_not_for("estimate", *_EXTRACTION, *_SURGERY, *_SEARCH))


@dataclass(frozen=True)
class Merging:
    """How models are merged, beyond the config: ``random_seed`` of the seeded methods, ``allow_crimes`` (mix
    architectures), ``unsafe_truncate_embeddings`` (vocabularies of different sizes keep their common leading rows;
    config.json and the tokenizer are cut to match) and ``allow_same_experts`` (a mergekit-moe config whose experts
    are all one model, as mergekit-moe's ``--i-understand-this-is-not-useful-without-training``)."""

    random_seed: int = DEFAULT_SEED
    allow_crimes: bool = False
    unsafe_truncate_embeddings: bool = field(default=False, metadata=_not_for(*_SURGERY))
    # eval refuses a mergekit-moe config before this could matter
    allow_same_experts: bool = field(default=False, metadata=_not_for(*_EXTRACTION, *_SURGERY, "evaluate"))


@dataclass(frozen=True)
class Resources:
    """What a run may use, none of it changing the output (``device`` aside: a GPU may round differently):
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``), the RAM and GPU budgets ``max_memory``/``max_gpu_memory``
    (bytes or ``"6GB"``; None: a safe fraction of what the machine allows), ``max_disk`` (bytes kept on the local
    disk for the output), ``staging`` (None stages files on local disk only when OUT is on Drive or another remote
    filesystem, True always, False never, or a local directory), torch's ``num_threads``, the Hugging Face
    ``cache_dir`` for hub models, and ``stream_inputs``: read every hub input by HTTP Range instead of downloading
    its files (by default a file is streamed when the merge needs less than half of it, or when downloading it would
    break ``max_disk``). A resume computes on the device and reads the inputs as its run recorded."""

    device: str = field(default="cpu", metadata=_not_for("resume", "estimate_measure"))
    max_memory: int | str | None = None
    max_gpu_memory: int | str | None = field(default=None, metadata=_not_for(*_ESTIMATES, *_SEARCH))
    max_disk: int | str | None = field(default=None, metadata=_not_for(*_PASSES))
    staging: bool | PathLike | None = field(default=None, metadata=_not_for(*_PASSES, *_SEARCH))
    num_threads: int | None = field(default=None, metadata=_not_for(*_PASSES, *_SEARCH))
    cache_dir: PathLike | None = field(default=None, metadata=_not_for("resume", *_PASSES, *_SEARCH))
    stream_inputs: bool = field(default=False, metadata=_not_for("resume", *_EXTRACTION, *_PASSES, *_SEARCH))


@dataclass(frozen=True)
class Hub:
    """How an ``hf://`` OUT is written: created ``public`` (default: private), each file committed once uploaded,
    or in batches of ``commit_every`` files or after ``commit_interval`` seconds."""

    public: bool = field(default=False, metadata=_not_for("resume"))
    commit_every: int | None = None
    commit_interval: float | None = None


@dataclass(frozen=True)
class Stages:
    """A recipe's (several YAML documents) named stages: written to ``intermediate_dir`` (default
    ``OUT.intermediates``, or under the state dir for an ``hf://`` OUT), deleted at the end with
    ``cleanup_intermediates``. Refused with a one-document config."""

    intermediate_dir: PathLike | None = field(default=None, metadata=_not_for("resume"))
    cleanup_intermediates: bool = field(default=False, metadata=_not_for("estimate"))


@dataclass(frozen=True)
class Lora:
    """mergekit-extract-lora's options (same names and defaults; :class:`~resumerge.runs.extract.spec.ExtractSpec`),
    plus ``exact``: mergekit's full SVD instead of the seeded randomized truncation."""

    max_rank: int = 128
    sv_epsilon: float = 0.0
    distribute_scale: bool = True
    embed_lora: bool = False
    save_modules: Sequence[str] = ()
    exclude_regexes: Sequence[str] = ()
    include_regexes: Sequence[str] = ()
    skip_undecomposable: bool = False
    exact: bool = False

    def __post_init__(self) -> None:
        # Kept as tuples (a list given is copied): the group stays a value, equal to the same options given again.
        for name in ("save_modules", "exclude_regexes", "include_regexes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class Surgery(SurgeryChoices):
    """mergekit-tokensurgeon 0.1.5's options (same names and defaults;
    :class:`~resumerge.runs.transplant.spec.SurgerySpec`): the ``approximation_method`` of the rows of DONOR's tokens
    MODEL lacks, its ``k`` atoms or neighbours, ``cosine_similarity`` and ``weight_scheme`` (common_interpolation),
    ``subword_method``, ``batch_size`` tokens per approximated (and journaled) batch, ``prefix_match`` and
    ``byte_match`` (yes, no, embed, lm_head), ``magikarp`` (match only tokens both models trained well), and
    ``new_vocab_noise``/``new_vocab_scale`` of the approximated rows."""


@dataclass(frozen=True)
class Trackers:
    """Where a search (``evolve``) is logged: ``wandb`` (mergekit-evolve's ``--wandb``, to ``wandb_project`` of
    ``wandb_entity``, None: yours) and ``trackio`` (to ``trackio_project``); a row per candidate, a summary per
    generation, ``best.yml`` as an artifact when the best changes."""

    wandb: bool = False
    wandb_project: str = "mergekit-evolve"
    wandb_entity: str | None = None
    trackio: bool = False
    trackio_project: str = "resumerge-evolve"


@dataclass(frozen=True)
class Search(SearchOptions):
    """How CMA-ES searches (``evolve``, mergekit-evolve's options and defaults;
    :class:`~resumerge.runs.evolve.options.SearchOptions`): ``max_fevals`` evaluations (the last generation cut to
    what is left), ``popsize`` candidates a generation (None: cma's 4 + 3 ln n), the first step size ``sigma0`` and
    the ``random_seed`` of its draws."""


@dataclass(frozen=True)
class Harness:
    """How lm-evaluation-harness runs the tasks of an evaluation (``evaluate``, lm-eval's options and meanings):
    task YAMLs from ``include_path`` too, at most ``limit`` documents a task (below 1: that share), ``num_fewshot``
    examples a prompt (None: each task's own), each prompt through the chat template (``apply_chat_template``; a
    name: one of several), lm-eval's results file written under ``output_path`` (with each task's samples where
    ``log_samples``), and lm-eval's seeds (``seed``) as its ``--seed`` writes them (``"0,1234,1234,1234"``: python's
    random, numpy, torch, the few-shot sampler; one figure for all four; None: that default)."""

    include_path: PathLike | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool | str = False
    log_samples: bool = False
    output_path: PathLike | None = None
    seed: str | int | None = None


# The calls that write a run, and their estimates, which take one Settings (below), and the evaluation, which writes
# no run (no OUT: no output, hub or stages options).
_NO_HUB = ("estimate", "estimate_extraction", "estimate_tokensurgeon", *_SEARCH, "evaluate")
_NO_OUT = ("resume", "evaluate")


@dataclass(frozen=True)
class Settings:
    """Everything a call that writes a run (``run``, ``resume``, ``extract_lora``, ``tokensurgeon``, ``evolve``),
    its estimate, an evaluation (``evaluate``, which writes no run: no ``output``, ``hub`` or ``stages``), a pass
    (``check``, ``measure``), an unwritten merge (``open_unwritten``), a plan (``plan_merge``) and a reading of what a
    run recorded (``status``, ``verify``: the state dir alone) read besides what they are asked to do, as one value a
    notebook builds once and hands to each call (``settings=``; a field given as a keyword of its own is refused
    with this spelling: :mod:`.keywords`): the groups ``output``, ``merging``, ``resources``, ``hub`` and
    ``stages``, the ``state_dir`` keeping the runs' records (None: ``RESUMERGE_STATE_DIR``, else the default) and
    the ``executor`` computing the shards (None or ``LocalExecutor()``: this process; ``RayExecutor(address,
    keep_workers)``: a Ray cluster). A group or field a call cannot honour is refused there when set (UsageError,
    exit 2), as :func:`taken` says."""

    output: Output = field(default=Output(), metadata=_not_for(*_NO_OUT, *_PASS_CALLS, *_READING))
    merging: Merging = field(default=Merging(), metadata=_not_for("resume", *_SEARCH, *_PASS_CALLS, *_READING))
    resources: Resources = field(default=Resources(), metadata=_not_for(*_READING, "plan_merge"))
    hub: Hub = field(default=Hub(), metadata=_not_for(*_NO_HUB, *_PASS_CALLS, *_READING, *_OPENED, "plan_merge"))
    stages: Stages = field(default=Stages(), metadata=_not_for(*_EXTRACTION, *_SURGERY, *_SEARCH, "evaluate",
                                                                *_PASS_CALLS, *_READING, *_OPENED, "plan_merge"))
    state_dir: PathLike | None = None
    executor: Executor | None = field(default=None, metadata=_not_for(*_EXTRACTION, *_SURGERY, *_READING, *_OPENED,
                                                                     "plan_merge"))


GROUPS = (Output, Merging, Resources, Hub, Stages, Lora, Surgery, Trackers, Search, Harness, Settings)


def taken(group: object, function: str) -> None:
    """Refuse a field of ``group`` that ``function`` cannot honour, set to other than its default (UsageError); a
    field that is itself a group (a :class:`Settings`' ``resources``) is walked the same way."""
    for each in fields(group):  # type: ignore[arg-type]
        value = getattr(group, each.name)
        if function in each.metadata.get("not_for", ()) and value != each.default:
            raise UsageError(f"{each.name} does not apply to {function}",
                             hint=f"leave {type(group).__name__}.{each.name} at its default here")
        if type(value) in GROUPS:
            taken(value, function)


def plan_options(*groups: object, out_shard_size: int | str | None, **overrides: Any) -> PlanOptions:
    """What changes the output's bytes (the plan's fingerprint; ``num_threads`` only for the methods whose bytes
    depend on it, the planner drops it for the others; shard size None: the planner's pick; output shards named
    like the parent's, as every new run's): every field of ``groups`` that :class:`PlanOptions` has, by name, then
    ``overrides``. UsageError if bad."""
    from resumerge.config.outformats import out_format, out_types, takes
    from resumerge.merge.engine.devices import normalise_device
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.sharding import AUTO_SHARD_SIZE  # the planner picks (an hf:// OUT's default)

    # the tensor-type file is read here: its pairs, not its path, are the plan's
    names = {each.name for each in fields(PlanOptions)} - {"out_shard_size", "parent_shard_names"} | {TYPE_FILE}
    given = {each.name: getattr(group, each.name) for group in groups
             for each in fields(group) if each.name in names}  # type: ignore[arg-type]
    given.update(overrides)
    if out_format(given.get("out_type", "safetensors")) is None:
        raise UsageError(f"--out-type {given['out_type']}: one of {', '.join(out_types())}")
    if given.get("gguf_split_max_size") is not None:
        if not takes(given.get("out_type"), "gguf_split_max_size"):
            raise UsageError("--gguf-split-max-size splits a GGUF output: give it with --out-type gguf")
        given["gguf_split_max_size"] = size_option(given["gguf_split_max_size"], "--gguf-split-max-size")
    if given.get("gguf_target_size") is not None:
        given["gguf_target_size"] = size_option(given["gguf_target_size"], "--gguf-target-size")
    given.update(gguf_options(given))
    given.pop(TYPE_FILE, None)
    shard_size = size_option(out_shard_size, "--out-shard-size")
    return PlanOptions(out_shard_size=AUTO_SHARD_SIZE if shard_size is None else shard_size,
                       parent_shard_names=True, **{**given, "device": normalise_device(given.get("device", "cpu"))})


def run_settings(state_dir: PathLike | None, resources: Resources, hub: Hub | None = None, *,
                 executor: Executor | None = None) -> RunSettings:
    """What never changes the output's bytes: ``resources``, how an ``hf://`` OUT is written (``hub``; None: the
    default, for a call that writes none), the ``executor``; raises UsageError (exit 2) for a bad value, before any
    work (an executor that cannot run here, as Ray's without Ray installed, is one). A forward pass's call
    (``check``, ``measure``) takes its settings here too: its executor placing the pass, its memory budget."""

    output = None if hub is None else hub_output(hub.public, hub.commit_every, hub.commit_interval)
    if resources.num_threads is not None and resources.num_threads < 1:
        raise UsageError("--num-threads must be at least 1")
    settings = RunSettings(state=StateDir.resolve(state_dir), cache_dir=resources.cache_dir,
                           max_memory=size_option(resources.max_memory, "--max-memory"),
                           max_gpu_memory=size_option(resources.max_gpu_memory, "--max-gpu-memory"),
                           staging=resources.staging, max_disk=size_option(resources.max_disk, "--max-disk"),
                           num_threads=resources.num_threads, executor=executor)
    if executor is not None:  # the default, this process, needs nothing (nor the merge engine imported to say so)
        from resumerge.merge.engine.executors import executor_of

        executor_of(settings).check()
    return settings if output is None else replace(settings, output=output)


def settings_for(settings: Settings, function: str) -> RunSettings:
    """What never changes the output's bytes for the call ``function`` given ``settings``: what it cannot honour
    refused (:func:`taken`), the rest as :func:`run_settings` makes it (the hub's options only for a call that
    writes an ``hf://`` OUT)."""
    taken(settings, function)
    hub = None if function in _NO_HUB else settings.hub
    return run_settings(settings.state_dir, settings.resources, hub, executor=settings.executor)


def pass_settings(function: str, settings: Settings) -> RunSettings:
    """The settings of a forward pass's call ``function`` (``check``, ``measure``): its ``resources``, state dir and
    executor (any other group, and the resources it cannot honour, refused), as ``run`` takes them (UsageError, exit
    2, for a bad one)."""
    taken(settings, function)
    return run_settings(settings.state_dir, settings.resources, executor=settings.executor)


def pass_placement(settings: RunSettings) -> PassPlace:
    """Where the settings' executor places a forward pass
    (:meth:`~resumerge.merge.engine.executors.PlacesPasses.place_pass`, named as the executor is:
    :data:`~resumerge.config.passplace.HERE` this process, ``ray`` an actor per model on a Ray cluster)."""
    if settings.executor is None:  # the merge engine (api.checked's executors) is never imported for a local pass
        from resumerge.config.passplace import HERE

        return HERE
    from resumerge.api.checked import check_placement

    return check_placement(settings.executor)


@contextlib.contextmanager
def started_early(settings: RunSettings, out: PathLike, device: str | None = "cpu") -> Iterator[RunSettings]:
    """``settings`` with what their executor starts while the run plans (a Ray run's workers: see
    :meth:`~resumerge.merge.engine.executors.Executor.starting`), ended as the call ends, however it ends; ``device``
    None where it is not known yet."""
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.merge.engine.executors import executor_of

    bounded = settings.max_disk is not None and is_hub_target(out)
    with executor_of(settings).starting(settings, device=device, bounded=bounded) as started:
        yield replace(settings, executor=started)


def recorded_device(out: PathLike, settings: RunSettings) -> str | None:
    """The device the run recorded for ``out`` computes on, for a resume's :func:`started_early` (a Ray run's warm
    workers start without a GPU, which a GPU plan's run can never take): as its ledger in the state dir says, else
    as OUT's manifest in a folder says. None where only the hub can say (an ``hf://`` OUT whose state dir holds no
    ledger of it: the resume reads the repo's manifest itself, and starts no warm worker before). "cpu" for a local
    run and where nothing here can say (nothing recorded, or unreadable: the resume itself says what is wrong)."""
    from resumerge.merge.engine.executors import executor_of

    if not executor_of(settings).starts_early:
        return "cpu"
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.merge.store.ledger_read import reading, run_row
    from resumerge.merge.store.manifest import read_manifest

    path, row = settings.state.run(out).ledger, None
    if path.is_file():
        try:
            with reading(path, "ledger") as conn:
                row = run_row(conn)
        except LedgerError:
            row = None
    if row is not None:
        return str(row.options.get("device", "cpu"))
    if is_hub_target(out):
        return None
    try:
        manifest = read_manifest(Path(out))
    except (LedgerError, OSError):
        return "cpu"
    return "cpu" if manifest is None else str(manifest.options.get("device", "cpu"))


def hub_output(public: bool, every: int | None, interval: float | None) -> HubOutputOptions:
    """How an ``hf://`` OUT is created and committed (``--public``, ``--commit-every``, ``--commit-interval``)."""
    return HubOutputOptions.of(public=public, every=every, interval=interval)


def size_option(value: int | str | None, option: str) -> int | None:
    """A size option in bytes (None: not given); raises UsageError for a size that is not positive."""
    if value is None:
        return None
    size = parse_size(value, option=option)
    if size <= 0:
        raise UsageError(f"{option} must be positive")
    return size


def single_merge_only(config: PathLike, out: PathLike, settings: RunSettings, *,
                      intermediate_dir: PathLike | None, cleanup_intermediates: bool) -> None:
    """Refuse recipe-only options with a one-document config, and a single merge into a recipe's OUT (even with
    ``restart``: the recipe's record would be left stale)."""
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.runs.recipes.held import is_recipe_out
    from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME

    for flag, given in (("intermediate-dir", intermediate_dir is not None), ("cleanup-intermediates",
                                                                             cleanup_intermediates)):
        if given:
            raise UsageError(f"--{flag} applies to recipes only, and {source_name(config, 'the config')} holds one "
                             "merge config", hint="separate a recipe's stages with --- lines")
    # A repo is asked (one small request): a single merge must not take over, or --restart away, a recipe's repo.
    if is_recipe_out(out, settings.state) if is_hub_target(out) else \
            os.path.isfile(os.path.join(out, RECIPE_MANIFEST_NAME)):
        raise OutputDirError(f"{out} holds the output of a recipe ({RECIPE_MANIFEST_NAME})", path=str(out),
                             hint="use another OUT for a single merge")


def is_yaml_text(config: PathLike) -> bool:
    """The rule for every ``config`` parameter: a ``Path`` (any ``os.PathLike``) names a file; a ``str`` is YAML
    text when it holds a newline or is a YAML mapping on one line (``"{merge_method: linear, models: [...]}"``) and
    names no existing file; any other ``str`` names a file."""
    if not isinstance(config, str):
        return False
    if "\n" in config:
        return True
    if os.path.isfile(config):
        return False
    import yaml

    try:
        return isinstance(yaml.safe_load(config), dict)
    except yaml.YAMLError:
        return False


def usable_device(device: str) -> None:
    """A GPU the run would refuse is refused by the estimate too (exit 2), rather than a plan that "fits"."""
    if device != "cpu":
        from resumerge.machine.memory.cuda import CudaProbe

        CudaProbe(device)


def config_text(config: PathLike) -> str:
    """The YAML text of ``config`` (see :func:`is_yaml_text`); raises UsageError for a file that cannot be read."""
    if isinstance(config, str) and is_yaml_text(config):
        return config
    from resumerge.config.merge_config import read_config_file

    return read_config_file(config)


def source_name(config: PathLike, text_name: str) -> str:
    """The name errors about ``config`` start with: its file name, or ``text_name`` for YAML text."""
    return text_name if is_yaml_text(config) else Path(config).name


def stop_flag(should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
    """``should_stop``, or a flag that never turns true."""
    return should_stop if should_stop is not None else (lambda: False)


@contextlib.contextmanager
def nothing_written() -> Iterator[None]:
    """An estimate (``plan``, ``extract-lora --plan``), which records and writes nothing: an
    :class:`~resumerge.errors.UnreachableError` met inside the block is raised as
    :class:`~resumerge.errors.UnreachableInputError` (exit 2, "plan writes nothing: … run the same command
    again"), never exit 3's "resume finishes it"."""
    from resumerge.errors import UnreachableError, UnreachableInputError

    try:
        yield
    except UnreachableError as exc:
        raise UnreachableInputError.before_start(exc, done="plan writes nothing") from None


@contextlib.contextmanager
def nothing_started(where: RunLocations) -> Iterator[None]:
    """A new run into ``where.out``: an :class:`~resumerge.errors.UnreachableError` met inside the block while this
    state dir records no run into ``out`` (no ledger of a merge, nor of a recipe) is raised as
    :class:`~resumerge.errors.UnreachableInputError` ("nothing was started: … run the same command again", exit
    2), whether the hub was unreachable for an input or for OUT itself: exit 3's "resume" would find nothing to
    finish. Once a run is recorded it stays exit 3 (resume finishes it)."""
    from resumerge.errors import UnreachableError, UnreachableInputError
    from resumerge.runs.recipes.ledger_read import RECIPE_LEDGER_NAME
    from resumerge.runs.recipes.manifest import recipe_dir

    try:
        yield
    except UnreachableError as exc:
        if where.ledger.exists() or (recipe_dir(where) / RECIPE_LEDGER_NAME).exists():
            raise UnreachableError.after_start(exc, where.resume_command) from None
        raise UnreachableInputError.before_start(exc) from None
