"""``resumerge plan`` for a multi-stage recipe: every stage validated and estimated, and the disk they share.

Each stage is estimated like a single merge into its own output dir (RAM, time, its own output on its disk).
Stages run one after another, so RAM and time do not add up across stages, but their outputs do: the
intermediates stay on disk until the final merge is verified (and after it, unless ``--cleanup-intermediates``),
so every filesystem must hold the sum of the stage outputs written to it, not just the largest.

Each stage's compute is timed on samples of its own inputs where they exist already; a stage that reads an
earlier stage's output (not written yet) is timed on synthetic tensors of the same shapes and dtype, which its
note says (see :mod:`resumerge.analyses.estimate.compute`). The stages share the timing budget.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from resumerge.analyses.estimate.compute import SAMPLE_SECONDS
from resumerge.analyses.estimate.costs import Estimate
from resumerge.analyses.estimate.estimate import estimate
from resumerge.analyses.estimate.measuring import Measuring
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.settings import RunSettings
from resumerge.machine.diskprobe import DEFAULT_PROBE_BYTES, DiskFree, device_of, free_bytes, nearest_existing
from resumerge.machine.memory.sizes import format_size
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.prepared import Prepared
from resumerge.runs.recipes.plan import default_intermediate_dir, plan_recipe, refuse_streamed_recipe
from resumerge.runs.recipes.recipe import load_recipe_text


@dataclass(frozen=True)
class StageEstimate:
    """One stage's label, output dir, whether it is the final merge, and its estimate."""

    label: str
    out_dir: str
    final: bool
    estimate: Estimate

    @property
    def heading(self) -> str:
        """``LABEL (final) -> OUT``: the line ``plan`` prints above the stage's estimate."""
        return f"{self.label}{' (final)' if self.final else ''} -> {self.out_dir}"


@dataclass(frozen=True)
class RecipeEstimate:
    """Every stage's estimate in run order, plus the reasons the recipe as a whole will not fit."""

    stages: tuple[StageEstimate, ...]
    reasons: tuple[str, ...]
    fingerprint: str

    def __repr__(self) -> str:
        """What ``resumerge plan`` prints, stage by stage (each stage's estimate as its own text), not every
        stage's whole plan."""
        return "\n\n".join(f"{stage.heading}\n{stage.estimate!r}" for stage in self.stages)

    @property
    def fits(self) -> bool:
        """True when every stage fits and the stages' outputs fit their disks together."""
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        """``{"recipe": true, "fits", "verdict", "reasons", "fingerprint", "stages": [{"stage", "out_dir",
        "final", "estimate": <single-merge plan JSON>}]}``."""
        return {
            "recipe": True,
            "fits": self.fits,
            "verdict": "fits" if self.fits else "will not fit",
            "reasons": list(self.reasons),
            "fingerprint": self.fingerprint,
            "stages": [
                {"stage": s.label, "out_dir": s.out_dir, "final": s.final, "estimate": s.estimate.to_json()}
                for s in self.stages
            ],
        }


def estimate_recipe(
    text: str,
    options: PlanOptions,
    settings: RunSettings,
    *,
    out_dir: str | os.PathLike[str],
    source: str = "recipe",
    intermediate_dir: str | os.PathLike[str] | None = None,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    disk_free: DiskFree = free_bytes,
) -> RecipeEstimate:
    """Validate the recipe ``text`` (every stage, against the planned outputs of the stages it reads) and
    estimate each stage under ``settings``; writes nothing. Raises what
    :func:`resumerge.runs.recipes.run.run_recipe` raises before any work (exit 2 errors); a recipe that is valid
    but does not fit is reported in :attr:`RecipeEstimate.reasons`. ``out_dir`` may be an ``hf://`` target: the
    final stage is then estimated as a single merge to the hub (its local disk is its staging, bounded by
    ``settings.max_disk``) and the named stages go under the state dir by default.
    """
    refuse_streamed_recipe(options)
    recipe = load_recipe_text(text, source=source)
    to_hub, state = is_hub_target(out_dir), settings.state
    out = str(out_dir) if to_hub else Path(out_dir).absolute()
    inter = Path(intermediate_dir).absolute() if intermediate_dir is not None else default_intermediate_dir(out, state)
    rplan = plan_recipe(recipe, out, inter, options, state=state, cache_dir=settings.cache_dir)
    stages = []
    reasons: list[str] = []
    # `plan` stays quick however many stages there are: they share the timing budget, a second each at least.
    per_stage = max(1.0, SAMPLE_SECONDS / max(1, len(rplan.stages)))
    for sp in rplan.stages:
        hub = to_hub and sp.final
        # --max-disk bounds only what the final stage stages for a repo OUT (the intermediates are written whole).
        stage_settings = settings if hub else replace(settings, max_disk=None)
        measuring = Measuring(probe_bytes=probe_bytes if sp.final and not hub else 0, disk_free=disk_free,
                              compute_budget=per_stage)
        est = estimate(Prepared(sp.plan, rplan.inputs), sp.stage.text, stage_settings,
                       out_dir=None if hub else sp.out_dir, measuring=measuring, choose_inputs=False, to_hub=hub)
        stages.append(StageEstimate(sp.stage.label, str(rplan.out_of(sp)), sp.final, est))
        reasons.extend(f"{sp.stage.label}: {reason}" for reason in est.reasons)
    reasons.extend(_shared_disk_reasons(stages, disk_free))
    return RecipeEstimate(tuple(stages), tuple(dict.fromkeys(reasons)), rplan.fingerprint)


def _shared_disk_reasons(stages: list[StageEstimate], disk_free: DiskFree) -> list[str]:
    """Stage outputs that share a filesystem must fit on it together (intermediates stay until the end)."""
    by_device: dict[int, list[StageEstimate]] = defaultdict(list)
    where: dict[int, Path] = {}
    for stage in stages:
        if is_hub_target(stage.out_dir):  # a repo is not on a local disk
            continue
        path = nearest_existing(Path(stage.out_dir))
        device = device_of(path)
        by_device[device].append(stage)
        where.setdefault(device, path)
    reasons = []
    for device, group in by_device.items():
        if len(group) < 2:
            continue
        needed = sum(s.estimate.output.total_bytes - s.estimate.output.committed_bytes for s in group)
        free = disk_free(where[device])
        if needed > free:
            reasons.append(
                f"the {len(group)} stage outputs on {where[device]} need {format_size(needed)} together but "
                f"{format_size(free)} is free: free space, or put --intermediate-dir on another disk"
            )
    return reasons
