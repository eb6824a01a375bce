"""From a transplant's recorded text to its plan: the one entry the session path calls for a transplant.

``--magikarp`` makes the match depend on the weights (which tokens each model trained well), and a plan fixes every
row's source before a shard is written, so a run with it reads the two models' embeddings and heads once here, after
every check has passed; a resume reads them again and finds the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import resumerge.runs.transplant.units as registered
from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.hub import HubEvent
from resumerge.inputs.source import InputSources
from resumerge.machine import killpoints
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.inputrefs import read_value, tensor_ref
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.prepared import Prepared
from resumerge.runs.transplant.adds import OutputAdds, output_adds
from resumerge.runs.transplant.batches import BATCHES_DIR, BatchStore
from resumerge.runs.transplant.magikarp import well_trained
from resumerge.runs.transplant.planner import (
    Matrices,
    Opened,
    build_plan,
    donor_head,
    find_matrices,
    match_vocabularies,
    open_pair,
    surgery_method,
    vocabularies,
)
from resumerge.runs.transplant.spec import SurgerySpec, load_spec_text
from resumerge.runs.transplant.tokens import MatrixMatch, Normalized, Vocabulary
from resumerge.runs.transplant.units import Transplant

KIND = "tokensurgeon"


def prepare_surgery(text: str, options: PlanOptions, settings: RunSettings, *,
                    out: str | os.PathLike[str] | None = None, model_dirs: Mapping[str, str] | None = None,
                    on_progress: Callable[[HubEvent], None] | None = None) -> Prepared:
    """Open the models of the transplant recorded as ``text``, match their vocabularies and build its plan, with the
    run's :class:`~resumerge.runs.transplant.units.Transplant` in its resources; finished batches are kept in ``out``'s
    run folder (none kept without ``out``: a ``--plan`` estimate)."""
    return planned_surgery(text, options, settings.state, settings.cache_dir, out=out, model_dirs=model_dirs,
                           on_progress=on_progress)


def planned_surgery(text: str, options: PlanOptions, state: StateDir, cache_dir: str | os.PathLike[str] | None, *,
                    out: str | os.PathLike[str] | None = None, model_dirs: Mapping[str, str] | None = None,
                    on_progress: Callable[[HubEvent], None] | None = None) -> Prepared:
    """:func:`prepare_surgery` with the state dir and hub cache given apart (a recipe's tokensurgeon stage)."""
    spec = load_spec_text(text)
    opened = open_pair(spec, model_dirs=model_dirs, state=state, cache_dir=cache_dir, on_progress=on_progress)
    matrices = find_matrices(opened, allow_crimes=options.allow_crimes)
    method = surgery_method(spec, opened, matrices)
    matches, adds = _matched(opened, spec, matrices, options)
    killpoints.reach("after_surgery_match")  # planning: nothing recorded yet (tests kill there)
    plan = build_plan(spec, opened, matrices, matches, options, adds)
    store = batch_store(out, state) if out is not None else None
    # A batch's pursuit is small kernels on one thread; the run's threads compute batches side by side.
    workers = max(1, options.num_threads or torch.get_num_threads())
    transplant = Transplant(matches, method, spec.batch_size, store, registered.CHUNK_BYTES, workers)
    return Prepared(plan, opened.inputs, Resources((transplant,)), kind=KIND)


def _matched(opened: Opened, spec: SurgerySpec, matrices: Matrices, options: PlanOptions
             ) -> tuple[dict[str, MatrixMatch], OutputAdds]:
    """Each matrix's match (every refusal before a weight is read, ``--magikarp``'s reads after them) and what
    the output's tokenizer adds around a text (:mod:`.adds`). The two tokenizers live only in here: they are let go
    when it returns."""
    vocabs = vocabularies(opened, subword=spec.approximation_method == "subword")
    matches = match_vocabularies(opened, spec, matrices, vocabs, out_type=options.out_type)
    if spec.magikarp:
        trained, junk = _magikarp(opened, matrices, vocabs)
        matches = match_vocabularies(opened, spec, matrices, vocabs, trained, junk, out_type=options.out_type)
    return matches, output_adds(*vocabs, matches["embed"])


def batch_store(out: str | os.PathLike[str], state: StateDir) -> BatchStore:
    """Where the transplant into ``out`` keeps its finished batches: its run folder's ``tokensurgeon-batches``."""
    return BatchStore(state.run_dir(out) / BATCHES_DIR)


def _magikarp(opened: Opened, matrices: Matrices, vocabs: tuple[Vocabulary, Vocabulary]
              ) -> tuple[set[Normalized], tuple[int, ...]]:
    """(the tokens MODEL may lend its rows for: well trained in both models; DONOR's rows of tokens well trained in
    neither, zeroed). MODEL's head is read only when untied (a tied MODEL's is not its own), DONOR's embedding
    stands for a tied DONOR's head, as 0.1.5 reads them."""
    sources = InputSources.local({k: str(m.directory) for k, m in opened.inputs.models.items()})
    try:
        def read(key: str, name: str) -> torch.Tensor:
            model = opened.inputs.models[key].recognised(CODECS)
            return read_value(tensor_ref(key, model, name), sources)

        embed, theirs = matrices.names["embed"]
        head = matrices.names["lm_head"][0] if "lm_head" in matrices.names else None
        mine = well_trained(vocabs[0].ids, read(opened.model_key, embed),
                            read(opened.model_key, head) if head else None)
        donors = well_trained(vocabs[1].ids, read(opened.donor_key, theirs),
                              read(opened.donor_key, donor_head(opened, matrices)))
    finally:
        sources.close()
    junk = tuple(i for t, i in vocabs[1].ids.items() if t not in donors and t not in mine)
    return mine & donors, junk
