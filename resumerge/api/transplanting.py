"""``tokensurgeon`` and its estimate: MODEL given DONOR's tokenizer (``resumerge tokensurgeon``), journaled like a
merge. :mod:`resumerge.api` re-exports both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from resumerge.api.keywords import one_spelling
from resumerge.api.kinds import SURGERY
from resumerge.api.options import (
    PathLike,
    Settings,
    Surgery,
    nothing_started,
    nothing_written,
    plan_options,
    settings_for,
    stop_flag,
)
from resumerge.api.reading import named
from resumerge.api.runkind import Call
from resumerge.config.settings import RunSettings

if TYPE_CHECKING:
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.runs.transplant.spec import SurgerySpec


@one_spelling
def tokensurgeon(
    model: str, donor: str, out: PathLike, settings: Settings = Settings(), *, surgery: Surgery = Surgery(),
    restart: bool = False, plan: bool = False, progress: Reporter | None = None,
    should_stop: Callable[[], bool] | None = None, fresh_process: bool = False,
) -> Outcome | Estimate:
    """Give ``model`` the tokenizer of ``donor`` into ``out``, like ``resumerge tokensurgeon`` (``surgery``:
    mergekit-tokensurgeon 0.1.5's options and meanings): MODEL's tensors, its token embedding and untied head with
    DONOR's vocabulary (rows of tokens both hold copied, the others approximated), MODEL's config.json with DONOR's
    vocabulary size and token ids, DONOR's tokenizer files. Journaled like a merge: :func:`resume` finishes it, each
    approximated batch of tokens kept until the run is done. ``settings`` mean what they mean for :func:`run` (no
    ``stages``, no ``executor``): ``settings.merging.allow_crimes`` lets a DONOR of another architecture lend its own
    token embedding; ``merging.random_seed`` seeds the random methods per batch.

    ``plan=True`` returns :func:`estimate_tokensurgeon`'s estimate instead, writing nothing.
    Raises UsageError (exit 2) for bad options, a DONOR without a tokenizer or one whose tensors do not line up.
    """
    call = _call(_spec(model, donor, surgery), out, settings, settings_for(settings, "tokensurgeon"))
    if plan:
        return _estimate(call, fresh_process)
    named(out)
    from resumerge.merge.engine.reporting import Driving  # the engine's, imported by a run alone

    driving = Driving(stop_flag(should_stop), restart=restart)
    call = replace(call, where=call.settings.state.run(out))
    with nothing_started(call.locations):
        SURGERY.check(call, driving)
        return SURGERY.run(call, replace(driving, reporter=progress))


@one_spelling
def estimate_tokensurgeon(
    model: str, donor: str, out: PathLike, settings: Settings = Settings(), *, surgery: Surgery = Surgery(),
    fresh_process: bool = False,
) -> Estimate:
    """Validate the transplant :func:`tokensurgeon` would run with these options and return its estimate, as
    :func:`estimate` does for a merge (``resumerge tokensurgeon --plan``), writing nothing."""
    call = _call(_spec(model, donor, surgery), out, settings, settings_for(settings, "estimate_tokensurgeon"))
    return _estimate(call, fresh_process)


def _spec(model: str, donor: str, surgery: Surgery) -> SurgerySpec:
    from resumerge.runs.transplant.spec import SurgerySpec, check_spec

    given: dict[str, Any] = {each.name: getattr(surgery, each.name) for each in fields(surgery)}
    spec = SurgerySpec(model=model, donor=donor, **given)
    check_spec(spec)  # before anything is opened or written
    return spec


def _call(spec: SurgerySpec, out: PathLike, asked: Settings, settings: RunSettings) -> Call:
    from resumerge.merge.plan.sharding import shard_size_choice
    from resumerge.runs.transplant.spec import spec_text

    # As a merge's: the default for a local OUT, the planner's pick for an hf:// one.
    options = plan_options(asked.output, asked.merging, asked.resources,
                           out_shard_size=shard_size_choice(asked.output.out_shard_size, out)[0])
    text = spec_text(spec)
    return Call(text, text, out, options, settings)


def _estimate(call: Call, fresh_process: bool) -> Estimate:
    from resumerge.analyses.estimate.measuring import Measuring

    with nothing_written():
        return SURGERY.estimate(call, Measuring(), fresh_process=fresh_process, intermediate_dir=None)
