"""From a transplant's recorded text to its plan: the one entry the session path calls for a transplant."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.inputs.hub import HubEvent
from resumerge.methods.resources import Resources
from resumerge.plan.merge_plan import PlanOptions
from resumerge.plan.prepared import Prepared
from resumerge.transplant.approximate import Method
from resumerge.transplant.batches import BATCHES_DIR, BatchStore
from resumerge.transplant.planner import build_plan, find_matrices, match_vocabularies, open_pair
from resumerge.transplant.spec import load_spec_text
from resumerge.transplant.units import Transplant

KIND = "tokensurgeon"


def prepare_surgery(text: str, options: PlanOptions, settings: RunSettings, *,
                    out: str | os.PathLike[str] | None = None, model_dirs: Mapping[str, str] | None = None,
                    on_progress: Callable[[HubEvent], None] | None = None) -> Prepared:
    """Open the models of the transplant recorded as ``text``, match their vocabularies and build its plan, with the
    run's :class:`~resumerge.transplant.units.Transplant` in its resources; finished batches are kept in ``out``'s
    run folder (none kept without ``out``: a ``--plan`` estimate)."""
    spec = load_spec_text(text)
    opened = open_pair(spec, model_dirs=model_dirs, state=settings.state, cache_dir=settings.cache_dir,
                       on_progress=on_progress)
    matrices = find_matrices(opened, allow_crimes=options.allow_crimes)
    matches = match_vocabularies(opened, spec, matrices)
    plan = build_plan(spec, opened, matrices, matches, options)
    method = Method(spec.approximation_method, spec.k, spec.cosine_similarity, spec.weight_scheme,
                    spec.subword_method, spec.new_vocab_noise, spec.new_vocab_scale)
    store = batch_store(out, settings.state) if out is not None else None
    transplant = Transplant(matches, method, spec.batch_size, store)
    return Prepared(plan, opened.inputs, Resources((transplant,)), kind=KIND)


def batch_store(out: str | os.PathLike[str], state: StateDir) -> BatchStore:
    """Where the transplant into ``out`` keeps its finished batches: its run folder's ``tokensurgeon-batches``."""
    return BatchStore(state.run_dir(out) / BATCHES_DIR)
