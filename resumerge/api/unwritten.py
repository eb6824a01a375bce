"""A merge config opened as the model it describes, never written (:func:`open_unwritten`), and a generation of
candidate configs over the same inputs (:func:`open_population`): planned as ``run`` plans them, refused in one
line (exit 2) before any weight is read, read through :mod:`resumerge.engine.unwritten`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.api.options import Merging, Output, PathLike, Resources, config_text, plan_options, run_settings
from resumerge.api.runkind import Call
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.engine.unwritten import UnwrittenMerge
    from resumerge.inputs.codecs import CodecTable
    from resumerge.memory import MemoryGovernor
    from resumerge.plan.merge_plan import Plan, PlanOptions


def open_unwritten(config: PathLike, *, state_dir: PathLike | None = None, output: Output = Output(),
                   merging: Merging = Merging(), resources: Resources = Resources(),
                   codecs: CodecTable | None = None, governor: MemoryGovernor | None = None) -> UnwrittenMerge:
    """The merge ``config`` describes (a merge config, or a recipe's final stage: mergekit-multi), as a model that
    is never written: planned as ``run`` plans it with the same option groups, its small files (config.json,
    tokenizer) in a folder under the state dir, each weight tensor merged by the plan's method code when it is read
    and dropped after (see :class:`~resumerge.engine.unwritten.UnwrittenMerge`), equal to the bytes ``run`` writes.
    ``governor``: the caller's memory governor, which admits each tensor's merge as the run admits it (None: one of
    ``resources.max_memory`` when given, else none). Raises ConfigError, InputError or UsageError (exit 2) before
    any weight is read: a config that does not plan, a mergekit-moe or extraction config, an output written as
    GGUF or as an adapter, a hub input whose weights are not in the cache."""
    from resumerge.api.kinds import kind_of, planner_of
    from resumerge.api.moe_kind import MoeKind
    from resumerge.api.recipe_kind import RecipeKind
    from resumerge.config.settings import RunSettings
    from resumerge.engine.unwritten import UnwrittenMerge

    text = config_text(config)
    options = _options(output, merging, resources)
    settings = run_settings(state_dir, resources)
    kind = kind_of(text)
    if isinstance(kind, MoeKind):
        raise UsageError("a mergekit-moe config cannot be read unwritten: its routers come from a forward pass of "
                         "their own", hint="merge it with resumerge run, then read the output")
    owned = governor is None and settings.max_memory is not None
    if owned:
        governor = _governor(settings.max_memory)
    if isinstance(kind, RecipeKind):
        return _recipe(text, options, settings.state, governor, owned=owned)
    call = Call(config, text, None, options, RunSettings(state=settings.state, cache_dir=settings.cache_dir),
                codecs=codecs)
    plan = planner_of(kind).plan(call)
    _readable(plan)
    return UnwrittenMerge(plan, text, settings.state.unwritten_dir, governor=governor,
                          on_close=governor.stop if owned and governor is not None else None)


def _options(output: Output, merging: Merging, resources: Resources) -> PlanOptions:
    """The plan options ``run`` would plan with, the outputs an unwritten merge cannot be refused (exit 2)."""
    if output.out_type != "safetensors":
        raise UsageError(f"an unwritten merge is read as safetensors, not --out-type {output.out_type}",
                         hint="drop --out-type, or write the merge with resumerge run and read the output")
    if output.out_adapter:
        raise UsageError("an unwritten merge is a model, not an adapter", hint="drop --out-adapter")
    return plan_options(output, merging, resources, out_shard_size=output.out_shard_size)


def _readable(plan: Plan) -> None:
    """Refuse a plan whose output is not a model (an extraction's adapter) or whose inputs' weights are not here
    (a hub input not downloaded): UsageError, before any weight is read."""
    if plan.side_files:
        raise UsageError("a LoRA extraction cannot be read unwritten: its output is an adapter, not a model")
    for model, reads in plan.inputs.items():
        directory = Path(plan.model_dirs[model])
        missing = sorted({file for file, _, _ in reads if not (directory / file).is_file()})
        if missing:
            raise UsageError(f"{model}'s weight file {missing[0]} is not in {directory}: an unwritten merge reads "
                             "its inputs from local files", hint="download the model first (resumerge run "
                             "downloads hub inputs), or give a local folder")


def _governor(max_memory: int | None) -> MemoryGovernor:
    from resumerge.memory import MemoryGovernor, SystemProbe

    assert max_memory is not None
    governor = MemoryGovernor(max_memory, SystemProbe())
    governor.start()
    return governor


def _recipe(text: str, options: PlanOptions, state: StateDir, governor: MemoryGovernor | None, *,
            owned: bool) -> UnwrittenMerge:
    """A recipe's final stage, unwritten, every stage it reads unwritten too: each stage's tensors merged, when
    read, from its inputs, a stage's output among them (its own :class:`MergedFiles`)."""
    import hashlib

    from resumerge.engine.unwritten import MergedFiles, UnwrittenMerge
    from resumerge.inputs.source import InputSources, LocalFiles
    from resumerge.recipes.plan import plan_recipe
    from resumerge.recipes.recipe import load_recipe_text

    recipe = load_recipe_text(text)
    # Where its outputs would go: never made (the stages' layout is checked against it as run checks OUT's).
    out = state.unwritten_dir / f"recipe-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    rplan = plan_recipe(recipe, out, out.with_name(f"{out.name}.intermediates"), options, state=state)
    stages: dict[str, MergedFiles] = {}
    sources: dict[str, LocalFiles] = {}
    for sp in rplan.stages:
        _readable_stage(sp.plan, set(stages))
        for key, directory in sp.plan.model_dirs.items():
            if key not in stages and key not in sources:
                sources[key] = LocalFiles(directory)
        inputs = InputSources({key: stages[key] if key in stages else sources[key] for key in sp.plan.model_dirs})
        if sp.final:
            def close() -> None:
                for stage in stages.values():
                    stage.close()
                for source in sources.values():
                    source.close()
                if owned and governor is not None:
                    governor.stop()

            return UnwrittenMerge(sp.plan, sp.stage.text, state.unwritten_dir, inputs=inputs, governor=governor,
                                  on_close=close)
        assert sp.stage.name is not None  # every stage but the final one is named
        # Admitted inside the final stage's admission of the tensor that reads it: a second reservation taken by
        # the thread holding the first could wait for it (resumerge.memory.governor).
        stages[sp.stage.name] = MergedFiles(sp.plan, inputs)
    raise AssertionError("a recipe has a final stage")


def _readable_stage(plan: Plan, stages: set[str]) -> None:
    """:func:`_readable` for a recipe's stage, whose inputs that are earlier stages are read unwritten."""
    from dataclasses import replace

    _readable(replace(plan, inputs={k: v for k, v in plan.inputs.items() if k not in stages}))
