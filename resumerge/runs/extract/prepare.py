"""From an extraction's recorded text to its plan: the one entry the session path calls for an extraction.

``--sv-epsilon`` makes a module's rank depend on its singular values, and a plan fixes every shape before a shard
is written, so a run with it first computes each module's truncation once to count the values above epsilon (the
same seeded computation the factors use, on the same one thread, so the counts agree); a resume recomputes the
same counts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import replace

from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.inputs.catalog import Inputs
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.hub import HubEvent
from resumerge.inputs.source import InputSources
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.inputrefs import read_value, tensor_ref
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.prepared import Prepared
from resumerge.runs.extract.decompose import kept_rank
from resumerge.runs.extract.factor_cache import FactorCache
from resumerge.runs.extract.factors import (
    FACTOR_A,
    FACTOR_A_FULL,
    TRUNCATION_THREADS,
    FactorStore,
    cache_key,
    truncation,
)
from resumerge.runs.extract.modules import LoraModule, ModuleChoice
from resumerge.runs.extract.planner import METHOD, build_extraction_plan, module_choice, module_seed, open_pair
from resumerge.runs.extract.spec import ExtractSpec, load_spec_text
from resumerge.runs.extract.state import FACTORS_DIR


def prepare_extraction(text: str, options: PlanOptions, settings: RunSettings, *,
                       out: str | os.PathLike[str] | None = None, model_dirs: Mapping[str, str] | None = None,
                       on_progress: Callable[[HubEvent], None] | None = None) -> Prepared:
    """Open the models of the extraction recorded as ``text`` and build its plan (reading weights only for
    ``--sv-epsilon``'s ranks, after every check has passed), with the run's
    :class:`~resumerge.runs.extract.factors.FactorStore` in its resources. Finished modules' factors are kept in
    ``out``'s run folder (none kept without ``out``: a ``--plan`` estimate)."""
    spec = load_spec_text(text)
    store = FactorStore(factor_cache(out, settings.state) if out is not None else None)
    inputs, ft_key, base_key = open_pair(spec, model_dirs=model_dirs, state=settings.state,
                                         cache_dir=settings.cache_dir, on_progress=on_progress)
    if spec.sv_epsilon > 0 and not spec.ranks:
        choice = module_choice(spec, inputs, ft_key, base_key, options)
        build_extraction_plan(spec, inputs, ft_key, base_key, options)  # every refusal before a weight is read
        spec = replace(spec, ranks=_probe_ranks(spec, choice, inputs, ft_key, base_key, options))
    return Prepared(build_extraction_plan(spec, inputs, ft_key, base_key, options), inputs, Resources((store,)))


def factor_cache(out: str | os.PathLike[str], state: StateDir) -> FactorCache:
    """Where the extraction into ``out`` keeps finished modules' factors: its run folder's ``extract-factors``
    (where ``status`` counts them)."""
    return FactorCache(state.run_dir(out) / FACTORS_DIR)


def forget_factors(plan: Plan, out: str | os.PathLike[str], state: StateDir) -> None:
    """Delete the cached factors of ``plan``'s modules (its adapter is committed: nobody needs them again); nothing
    for a plan that is not an extraction's."""
    if plan.method != METHOD:
        return
    keys = [cache_key(dict(tp.params)) for tp in plan.tensors.values() if tp.method in (FACTOR_A, FACTOR_A_FULL)]
    cache = factor_cache(out, state)
    cache.forget(keys)
    with contextlib.suppress(OSError):
        cache.directory.rmdir()  # empty now, unless another process's entries are there


def clear_factors(out: str | os.PathLike[str], state: StateDir) -> None:
    """Delete every cached factor of the extraction into ``out`` (``--restart``: the run they came from is
    discarded, and ``status`` must not count them)."""
    shutil.rmtree(factor_cache(out, state).directory, ignore_errors=True)


def _probe_ranks(spec: ExtractSpec, choice: ModuleChoice, inputs: Inputs, ft_key: str, base_key: str,
                 options: PlanOptions) -> tuple[tuple[str, int], ...]:
    """Each LoRA module's rank under ``spec.sv_epsilon`` (0 drops the module)."""
    sources = InputSources.local({k: str(m.directory) for k, m in inputs.models.items()})
    ranks = []
    try:
        for m in choice.lora:
            delta = _read(sources, inputs, ft_key, m) - _read(sources, inputs, base_key, m)
            if m.embedding:
                delta = delta.T
            if options.device != "cpu":
                delta = delta.to(options.device)
            t = truncation(delta, m.rank, exact=spec.exact, seed=module_seed(options.random_seed, m.name),
                           threads=TRUNCATION_THREADS)
            ranks.append((m.name, kept_rank(t.s, m.rank, spec.sv_epsilon)))
    finally:
        sources.close()
    return tuple(sorted(ranks))


def _read(sources: InputSources, inputs: Inputs, key: str, m: LoraModule) -> torch.Tensor:
    """Module ``m``'s weight in model ``key`` (decoded, when stored in a format the run recognises), cut to its
    kept rows."""
    t = read_value(tensor_ref(key, inputs.models[key].recognised(CODECS), m.weight), sources)
    return t[: m.keep_rows] if m.keep_rows is not None else t
