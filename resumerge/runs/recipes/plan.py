"""Plan every stage of a recipe up front, before any weight is read or any output written.

A later stage reads an earlier stage's output, which does not exist yet — but the earlier stage's plan already
fixes every tensor's name, dtype, shape, shard file and byte offset, and its ``config.json``. So each stage
output becomes a *virtual* :class:`~resumerge.inputs.model.ModelInput` built from its producer's plan, and the next
stage is planned against it like any model: slice layer counts, shapes and parameters of the whole recipe are
validated from the inputs' headers alone. A virtual file's identity is derived from the producer plan's
fingerprint and the file name, so a consumer's fingerprint changes exactly when its producer's plan does.

Inputs shared by stages (the same reference key) are opened once for the recipe; hub inputs get one metadata
resolution here and one verified download later (:func:`resumerge.inputs.catalog.fetch_inputs` on :attr:`inputs`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.config.hubtarget import is_hub_target, parse_hub_target
from resumerge.config.locations import StateDir
from resumerge.errors import ConfigError, ResumergeError, UsageError
from resumerge.inputs.catalog import Inputs, open_inputs
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.merge_plan import Plan, PlanOptions, fingerprinted
from resumerge.merge.plan.outguard import model_places, refuse_out_over
from resumerge.merge.plan.outmodel import planned_model
from resumerge.merge.plan.parameters import checked_method
from resumerge.merge.plan.planner import build_plan
from resumerge.runs.recipes.recipe import Recipe, Stage, near_stage_name, stage_errors

if TYPE_CHECKING:
    from resumerge.inputs.hub import ProgressCallback

INTERMEDIATE_SUFFIX = ".intermediates"


@dataclass(frozen=True)
class StagePlan:
    """One stage, its frozen plan, and where its output goes (OUT for the final merge)."""

    stage: Stage
    plan: Plan
    out_dir: Path
    final: bool


@dataclass(frozen=True)
class RecipePlan:
    """Every stage planned, in dependency order, with the recipe's real inputs opened once."""

    recipe: Recipe
    stages: tuple[StagePlan, ...]
    inputs: Inputs
    out_dir: Path
    intermediate_dir: Path
    options: PlanOptions
    fingerprint: str
    target: str | None = None  # the hf:// repo when OUT is one (then out_dir is only its name)

    @property
    def out(self) -> str | Path:
        """OUT as runs and messages name it: the ``hf://`` target, else the output directory."""
        return self.target if self.target is not None else self.out_dir

    def out_of(self, sp: StagePlan) -> str | Path:
        """Where ``sp`` writes: the ``hf://`` target for the final stage of a hub OUT, else its output dir."""
        return self.target if sp.final and self.target is not None else sp.out_dir

    @property
    def final(self) -> StagePlan:
        """The stage written to OUT."""
        return next(s for s in self.stages if s.final)

    def of(self, stage: Stage) -> StagePlan:
        """The plan of ``stage``."""
        return next(s for s in self.stages if s.stage is stage)

    def producers(self, sp: StagePlan) -> tuple[StagePlan, ...]:
        """The stages whose output ``sp`` reads."""
        return tuple(self.of(self.recipe.stage(name)) for name in sp.stage.needs)

    @property
    def model_dirs(self) -> dict[str, str]:
        """Directory of every real (non-stage) input, by reference key: recorded so a resume pins hub commits."""
        return {key: str(m.directory) for key, m in sorted(self.inputs.models.items())}


def refuse_streamed_recipe(options: PlanOptions | None) -> None:
    """Raise :class:`UsageError` (exit 2) for ``--stream-inputs`` on a recipe, whose stages download their hub
    inputs whole (once, for every stage): streaming them is not built, and a flag must not be ignored."""
    if options is not None and options.stream_inputs:
        raise UsageError("--stream-inputs applies to single merges; a recipe downloads its hub inputs whole",
                         hint="drop --stream-inputs, or merge the stages one config at a time")


def default_intermediate_dir(out_dir: str | os.PathLike[str], state: StateDir) -> Path:
    """Where named stages go without ``--intermediate-dir``: ``OUT.intermediates`` beside OUT (same disk as OUT,
    so a runtime reset that keeps OUT keeps the stages too; never inside OUT). For an ``hf://`` OUT, which has no
    "beside", ``<state dir>/hf-<namespace>--<name>-<hash>.intermediates``: local disk, next to the run's state."""
    if is_hub_target(out_dir):
        return state.root.absolute() / f"{parse_hub_target(str(out_dir)).state_key()}{INTERMEDIATE_SUFFIX}"
    out = Path(out_dir).absolute()
    return out.parent / f"{out.name}{INTERMEDIATE_SUFFIX}"


def stage_output_dir(stage: Stage, final: Stage, out_dir: Path, intermediate_dir: Path) -> Path:
    """OUT for the final merge, else ``intermediate_dir/<name>``."""
    if stage is final:
        return out_dir
    assert stage.name is not None
    return intermediate_dir / stage.name


def plan_recipe(
    recipe: Recipe,
    out_dir: str | os.PathLike[str],
    intermediate_dir: Path,
    options: PlanOptions,
    *,
    model_dirs: Mapping[str, str] | None = None,
    state: StateDir,
    cache_dir: str | os.PathLike[str] | None = None,
    on_progress: ProgressCallback | None = None,
) -> RecipePlan:
    """Open the recipe's inputs (config.json and headers only) and plan every stage; writes nothing.

    ``model_dirs`` are the input directories recorded by an earlier run (a resume pins the same hub commits);
    ``state`` is the run's state dir as the API resolved it (a transplant stage's planner takes it as is).
    ``out_dir`` may be an ``hf://`` target: the final stage then writes there (see :attr:`RecipePlan.target`).
    Raises :class:`UsageError` when an output dir overlaps OUT or holds an input, and the planner's errors (exit 2)
    prefixed with the stage (``[stage NAME] slices[0].sources[1].layer_range``).
    """
    target = parse_hub_target(str(out_dir)).url if is_hub_target(out_dir) else None
    out = Path(target) if target is not None else Path(out_dir).absolute()
    intermediate_dir = intermediate_dir.absolute()
    dirs = {s.key: stage_output_dir(s, recipe.final, out, intermediate_dir) for s in recipe.stages}
    if target is None:  # a repo cannot overlap a local folder
        _check_layout(out, intermediate_dir, dirs, recipe)
    _check_near_misses(recipe)
    for stage in recipe.stages:  # every stage's method, from the YAML, before the first stage opens a model
        if stage.surgery is None:
            with stage_errors(stage.label):
                checked_method(stage.config)
    opened: dict[str, ModelInput] = {}
    union = Inputs()
    virtual: dict[str, ModelInput] = {}
    planned: dict[str, StagePlan] = {}
    for stage in recipe.stages:
        with stage_errors(stage.label):
            if stage.surgery is not None:  # a transplant: its own planner opens MODEL and DONOR
                from resumerge.runs.transplant.prepare import planned_surgery

                prepared = planned_surgery(stage.surgery, options, state, cache_dir, model_dirs=model_dirs,
                                           on_progress=on_progress)
                plan, inputs = prepared.plan, prepared.opened()
            else:
                try:
                    inputs = open_inputs(stage.config, model_dirs=model_dirs, state=state, cache_dir=cache_dir,
                                         on_progress=on_progress, given={**opened, **virtual})
                except ResumergeError as exc:
                    _hint_stage_name(exc, recipe, stage)
                    raise
                plan = build_plan(stage.config, inputs.models, options)
        plan = _with_producer_tokenizer(plan, planned)
        for key, model in inputs.models.items():
            if key not in virtual:
                opened[key] = model
        union.hub.update(inputs.hub)
        sp = StagePlan(stage, plan, dirs[stage.key], stage is recipe.final)
        planned[stage.key] = sp
        if stage.name is not None:
            virtual[stage.name] = planned_model(stage.name, plan, sp.out_dir)
    union.models.update(opened)
    stages = tuple(planned[s.key] for s in recipe.stages)
    for sp in stages:  # no stage writes where the recipe reads (its own stages' outputs aside: planned, not read)
        if not (sp.final and target is not None):
            refuse_out_over(sp.out_dir, model_places(union.models),
                            what="OUT" if sp.final else f"the output of {sp.stage.label} ({sp.out_dir})")
    body = [[sp.stage.key, sp.plan.fingerprint, sp.final] for sp in stages]
    fingerprint = hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()
    return RecipePlan(recipe, stages, union, out, intermediate_dir, options, fingerprint, target)


def _with_producer_tokenizer(plan: Plan, planned: Mapping[str, StagePlan]) -> Plan:
    """A stage whose tokenizer donor is another stage copies the files that stage will write.

    The planner hashes the donor's tokenizer files on disk, which a stage that has not run yet does not have;
    its plan knows them already (the same names and sha256, copied verbatim), so those are authoritative.
    """
    donor = plan.tokenizer_donor
    if donor is None or donor not in planned:
        return plan
    producer = planned[donor].plan
    # The bytes too, so that the stage's plan can render (and plan can size) its tokenizer files before the
    # producer has run: they are the producer's own blobs, or the files it will copy from its donor.
    blobs = dict(producer.tokenizer_blobs)
    if not blobs and producer.tokenizer_donor is not None:
        source = Path(producer.model_dirs[producer.tokenizer_donor])
        blobs = {name: (source / name).read_bytes() for name, _ in producer.tokenizer_files}
    fixed = replace(plan, tokenizer_files=producer.tokenizer_files, tokenizer_blobs=blobs)
    return fingerprinted(fixed)


def _check_layout(out_dir: Path, intermediate_dir: Path, dirs: Mapping[str, Path], recipe: Recipe) -> None:
    real_out = os.path.realpath(out_dir)
    for stage in recipe.stages:
        if stage is recipe.final:
            continue
        real = os.path.realpath(dirs[stage.key])
        if real == real_out or _inside(real, real_out) or _inside(real_out, real):
            raise UsageError(
                f"the output of {stage.label} ({dirs[stage.key]}) would overlap OUT ({out_dir})",
                path=str(intermediate_dir),
                hint="choose an --intermediate-dir outside OUT (default: OUT.intermediates beside OUT)",
            )


def _inside(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip(os.sep) + os.sep)


def _check_near_misses(recipe: Recipe) -> None:
    """Refuse, before any network request, a reference that is one typo away from a stage name and can be
    neither a local folder nor an ``org/name`` hub repo."""
    names = {s.name for s in recipe.stages}
    for stage in recipe.stages:
        for ref in stage.config.referenced_models():
            if ref.path in names or "/" in ref.path or os.path.exists(os.path.expanduser(ref.path)):
                continue
            near = near_stage_name(recipe, ref.path)
            if near is not None:
                raise ConfigError(
                    f"{ref.path!r} is not a stage of this recipe, a local folder or an org/name hub repo",
                    yaml_path=f"[{stage.label}] {_where(stage, ref.path)}",
                    hint=f"did you mean stage {near!r}?",
                )


def _where(stage: Stage, path: str) -> str:
    from resumerge.inputs.catalog import yaml_path_of

    ref = next(r for r in stage.config.referenced_models() if r.path == path)
    return yaml_path_of(stage.config, ref)


def _hint_stage_name(exc: ResumergeError, recipe: Recipe, stage: Stage) -> None:
    names = {s.name for s in recipe.stages}
    for ref in stage.config.referenced_models():
        if ref.path in names:
            continue
        near = near_stage_name(recipe, ref.path)
        if near is not None and ref.path in exc.one_line():
            exc.hint = f"{ref.path!r} is not a stage of this recipe; did you mean {near!r}?"
            return
