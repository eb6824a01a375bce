"""A merge config opened as the model it describes, never written (:func:`open_unwritten`), and a generation of
candidate configs over the same inputs (:func:`open_population`): planned as ``run`` plans them, refused in one
line (exit 2) before any weight is read or downloaded, read through :mod:`resumerge.merge.engine.unwritten`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from resumerge.api.keywords import one_spelling
from resumerge.api.options import (
    PathLike,
    Settings,
    config_text,
    nothing_written,
    plan_options,
    run_settings,
    source_name,
    taken,
)
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.config.settings import RunSettings
    from resumerge.inputs.codecs import CodecTable
    from resumerge.machine.memory import MemoryGovernor
    from resumerge.merge.engine.unwritten import Population, UnwrittenMerge
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.plan.prepared import Prepared

# What a refused candidate is told to give instead.
_ONE_MERGE = "give each candidate as one YAML document of merge_method and its models"


@one_spelling
def open_unwritten(config: PathLike, settings: Settings = Settings(), *, codecs: CodecTable | None = None,
                   governor: MemoryGovernor | None = None) -> UnwrittenMerge:
    """The merge ``config`` describes (a merge config, or a recipe's final stage: mergekit-multi), as a model that
    is never written: planned as ``run`` plans it with the same ``settings`` (of them its ``output``, ``merging``,
    ``resources`` and ``state_dir``; ``hub``, ``stages`` and ``executor`` refused set), its small files (config.json,
    tokenizer) in a folder under the state dir, each weight tensor merged by the plan's method code when it is read
    and dropped after (see :class:`~resumerge.merge.engine.unwritten.UnwrittenMerge`), equal to the bytes ``run``
    writes. Hub inputs are downloaded into the Hugging Face cache and verified, as ``run`` downloads them (never twice).
    ``governor``: the caller's memory governor, which admits each tensor's merge as the run admits it (None: one of
    ``settings.resources.max_memory`` when given, stopped when the merge is closed, else none). Raises ConfigError,
    InputError or UsageError (exit 2) before any weight is read or downloaded: a config that does not plan, a
    mergekit-moe or extraction config, an output written as GGUF or as an adapter, ``stream_inputs``."""
    from resumerge.api.kinds import MERGE, kind_of
    from resumerge.api.recipe_kind import RecipeKind
    from resumerge.inputs.catalog import fetch_inputs
    from resumerge.merge.engine.unwritten import UnwrittenMerge

    text = config_text(config)
    options, given = _options(settings, "open_unwritten")
    kind = kind_of(text)
    with nothing_written():  # an unreachable hub: exit 2, nothing to resume
        if isinstance(kind, RecipeKind):
            return _recipe(text, options, given, governor)
        if kind is not MERGE:
            raise _not_a_merge(kind.name)
        prepared = _prepared(config, text, options, given, codecs)
        fetch_inputs(prepared.opened(), state=given.state)
    _threads(given)
    owned = _governor(given) if governor is None else None
    return UnwrittenMerge(prepared.plan, given.state.unwritten_dir, governor=governor or owned,
                          on_close=owned.stop if owned is not None else None)


@one_spelling
def open_population(configs: Sequence[PathLike], settings: Settings = Settings(), *,
                    codecs: CodecTable | None = None, governor: MemoryGovernor | None = None) -> Population:
    """A generation of candidate merge ``configs`` over the same input models, each planned as
    :func:`open_unwritten` plans it (the same refusals, exit 2, before any weight is read or downloaded; a recipe,
    and configs that read other models, are refused too), read together: see
    :class:`~resumerge.merge.engine.unwritten.Population` (what its pass holds:
    :meth:`~resumerge.merge.engine.unwritten.Population.holds`). ``governor``: the caller's, which admits each tensor's
    merge as the run admits it."""
    from resumerge.api.kinds import MERGE, kind_of
    from resumerge.inputs.catalog import fetch_inputs
    from resumerge.merge.engine.unwritten import Population, same_inputs

    if not configs:
        raise UsageError("a generation needs at least one candidate config", hint=_ONE_MERGE)
    options, given = _options(settings, "open_population")
    with nothing_written():
        prepared = []
        for config in configs:
            text = config_text(config)
            kind = kind_of(text)
            if kind is not MERGE:
                raise UsageError(f"a candidate of a generation is one merge config, and "
                                 f"{source_name(config, 'a candidate')} is a {kind.name} config", hint=_ONE_MERGE)
            prepared.append(_prepared(config, text, options, given, codecs))
        same_inputs([p.plan for p in prepared])
        fetch_inputs(prepared[0].opened(), state=given.state)
    _threads(given)
    return Population([p.plan for p in prepared], given.state.unwritten_dir, governor=governor)


def _options(settings: Settings, function: str) -> tuple[PlanOptions, RunSettings]:
    """The plan options ``run`` would plan with and the run's settings, of ``settings`` given to ``function``; what
    an unwritten merge cannot honour is refused (exit 2)."""
    from resumerge.config.outformats import out_format
    from resumerge.outputs.containers import container_class

    taken(settings, function)
    output, resources = settings.output, settings.resources
    if out_format(output.out_type) is None or not container_class(output.out_type).unwritten_reads:
        raise UsageError(f"an unwritten merge is read as safetensors, not --out-type {output.out_type}",
                         hint="drop --out-type, or write the merge with resumerge run and read the output")
    if output.out_adapter:
        raise UsageError("an unwritten merge is a model, not an adapter", hint="drop --out-adapter")
    if resources.stream_inputs:
        raise UsageError("an unwritten merge reads its hub inputs downloaded, not streamed",
                         hint="drop --stream-inputs (they are downloaded once into the Hugging Face cache)")
    return (plan_options(output, settings.merging, resources, out_shard_size=output.out_shard_size),
            run_settings(settings.state_dir, resources))


def _not_a_merge(kind: str) -> UsageError:
    if kind == "moe":
        return UsageError("a mergekit-moe config cannot be read unwritten: its routers come from a forward pass of "
                          "their own", hint="merge it with resumerge run, then read the output")
    return UsageError(f"a {kind} config cannot be read unwritten: its output is not a merged model",
                      hint="give a merge config (merge_method and its models), or a recipe of them")


def _prepared(config: PathLike, text: str, options: PlanOptions, settings: RunSettings,
              codecs: CodecTable | None) -> Prepared:
    """The merge config ``text`` planned as ``run`` plans it (its inputs opened: headers only)."""
    from resumerge.config.merge_config import load_config_text
    from resumerge.merge.engine.session import prepare

    return prepare(load_config_text(text, source=source_name(config, "config")), options, state=settings.state,
                   cache_dir=settings.cache_dir, codecs=codecs)


def _threads(settings: RunSettings) -> None:
    """torch's thread count set as ``run`` sets it (``-j``: the bytes of some methods depend on it), for the
    process, as ``run`` sets it for its own."""
    from resumerge.merge.engine.devices import set_torch_threads

    set_torch_threads(settings.num_threads)


def _governor(settings: RunSettings) -> MemoryGovernor | None:
    """A governor of ``--max-memory`` when given, started (None without one)."""
    if settings.max_memory is None:
        return None
    from resumerge.machine.memory import MemoryGovernor, SystemProbe

    governor = MemoryGovernor(settings.max_memory, SystemProbe())
    governor.start()
    return governor


def _recipe(text: str, options: PlanOptions, settings: RunSettings,
            governor: MemoryGovernor | None) -> UnwrittenMerge:
    """A recipe's final stage, unwritten, every stage it reads unwritten too: each stage's tensors merged, when
    read, from its inputs, a stage's output among them (its own :class:`MergedFiles`)."""
    import hashlib

    from resumerge.inputs.catalog import fetch_inputs
    from resumerge.inputs.source import InputSources, LocalFiles
    from resumerge.merge.engine.unwritten import MergedFiles, UnwrittenMerge
    from resumerge.runs.recipes.plan import plan_recipe
    from resumerge.runs.recipes.recipe import load_recipe_text

    state = settings.state
    recipe = load_recipe_text(text)
    # Where its outputs would go: never made (the stages' layout is checked against it as run checks OUT's).
    out = state.unwritten_dir / f"recipe-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    rplan = plan_recipe(recipe, out, out.with_name(f"{out.name}.intermediates"), options, state=state,
                        cache_dir=settings.cache_dir)
    fetch_inputs(rplan.inputs, state=state)
    _threads(settings)
    owned = _governor(settings) if governor is None else None
    stages: dict[str, MergedFiles] = {}
    sources: dict[str, LocalFiles] = {}
    for sp in rplan.stages:
        for key, directory in sp.plan.model_dirs.items():
            if key not in stages and key not in sources:
                sources[key] = LocalFiles(directory)
        inputs = InputSources({key: stages[key] if key in stages else sources[key] for key in sp.plan.model_dirs})
        if not sp.final:
            assert sp.stage.name is not None  # every stage but the final one is named
            # Admitted inside the final stage's admission of the tensor that reads it: a second reservation taken
            # by the thread holding the first could wait for it (resumerge.machine.memory.governor).
            stages[sp.stage.name] = MergedFiles(sp.plan, inputs)
            continue

        def close() -> None:
            for stage in stages.values():
                stage.close()
            for source in sources.values():
                source.close()
            if owned is not None:
                owned.stop()

        return UnwrittenMerge(sp.plan, state.unwritten_dir, inputs=inputs, governor=governor or owned,
                              on_close=close)
    raise AssertionError("a recipe has a final stage")
