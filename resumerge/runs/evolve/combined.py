"""A search of a merge's parameters, then of the merged model's structure, in one STORAGE (``resumerge evolve`` with
a parameter genome and a ``structure:`` block).

The config is mergekit-evolve's (its ``genome:`` the merge method's weights and densities per layer block) with a
``structure:`` mapping beside it: the structure genome's keys (``grow``, ``shrink``, ``repeat``, ``beam_*``,
``scales``, ``swap``, ``scale_search``, ``surrogate``; see :mod:`.shapes.genome`) but its ``model``, and its own
``held_out`` tasks; the ``tasks`` score both stages::

    genome: {models: [A, B], merge_method: ties, base_model: BASE, layer_granularity: 1}
    structure: {grow: 25, beam_width: 4, beam_depth: 1, held_out: [{nll: {texts: held.txt}}]}
    tasks: [{kl: {parent: A, texts: a.txt}}, {nll: {texts: b.txt}}]

**Why one stage after the other, and not alternating.** The two searches are each resumable at any instant already:
CMA-ES's generations journaled in its STORAGE (:mod:`.search`), the structure search's candidates recorded in its
own (:mod:`.shapes.search`), the merged model between them written by ``run`` (journaled: run again, it resumes or
answers at once). Run one after the other, each stage is an unchanged search in a folder of STORAGE and the combined
search is only the order of three resumable steps — no second search loop, no new journal: a kill anywhere leaves
one stage unfinished and every earlier one finished, and the next start runs the finished ones' no-op answers, then
resumes the unfinished one. The structure stage's base is the parameter optimum written to disk, so the cache holds
the *merged* model's hidden states once and every structure candidate runs only the layers it changes from them
(alternating would make a new base, and a new cache, each round: the saving lost). Structure edits of the merged
model (a block repeated, skipped, scaled) are what frankenmerges apply to a finished merge; the parameters found for
the unrepeated model are the natural start, and a later ``evolve`` of the winning shape's parameters remains open.

STORAGE holds ``parameters.yml`` and ``structure.yml`` (the two stages' configs, from the combined one: the same
bytes every start), ``parameters/`` (the parameter search's STORAGE), ``merged/`` (its best written by ``run``),
``structure/`` (the structure search's STORAGE: its base is ``merged/``) and ``best.yml``: the chosen combined config,
a mergekit-multi recipe whose stage ``parameters`` is the parameter search's best and whose final merge is the
structure search's best over that stage (``run best.yml OUT`` writes what the structure search scored).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resumerge.config.merge_config import parse_documents
from resumerge.errors import ConfigError

STRUCTURE = "structure"  # the config's key, the stage's STORAGE folder and its config's name (with .yml)
PARAMETERS = "parameters"  # the parameter stage's STORAGE folder, config's name and stage name in best.yml
MERGED = "merged"  # the parameter stage's best, written by run: the structure stage's base
STAGES = ("parameters (1 of 2)", "merge of the parameters' best", "structure (2 of 2)")
_COPIED = ("tasks", "limit", "num_fewshot", "apply_chat_template")  # the structure stage's from the combined


def is_combined(text: str) -> bool:
    """Whether the evolve config ``text`` asks for a combined search (a ``structure:`` key beside its genome)."""
    try:
        docs = parse_documents(text, source="CONFIG")
    except ConfigError:
        return False
    return len(docs) == 1 and isinstance(docs[0], dict) and STRUCTURE in docs[0]


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stage_texts(text: str, merged: Path) -> tuple[str, str]:
    """The parameter stage's config and the structure stage's (its base the model ``merged``), from the combined
    ``text``; a ``structure:`` that is not a mapping, that names a model, kind or sources, or a genome that is a
    structure genome itself, refused naming its YAML path (:class:`ConfigError`, nothing read)."""
    import yaml

    doc: dict[str, Any] = parse_documents(text, source="CONFIG")[0]
    asked = doc[STRUCTURE]
    if not isinstance(asked, dict):
        raise ConfigError("must be a mapping of the structure genome's keys", yaml_path=STRUCTURE)
    genome = doc.get("genome")
    if isinstance(genome, dict) and genome.get("kind") == STRUCTURE:
        raise ConfigError("a structure genome beside a structure block: the genome is the parameter stage's",
                          yaml_path="genome.kind", hint="give mergekit-evolve's genome, or leave out structure")
    for key, why in (("model", "its base is the parameter stage's best merge"), ("kind", "it is a structure one"),
                     ("sources", "a combined search's blocks come from the merged model alone")):
        if key in asked:
            raise ConfigError(f"not taken here: {why}", yaml_path=f"{STRUCTURE}.{key}")
    held = asked.get("held_out")
    shape = {"genome": {"kind": STRUCTURE, "model": str(merged),
                        **{k: v for k, v in asked.items() if k != "held_out"}},
             **{k: doc[k] for k in _COPIED if k in doc}, **({"held_out": held} if held is not None else {})}
    params = {k: v for k, v in doc.items() if k != STRUCTURE}
    return yaml.safe_dump(params, sort_keys=False), yaml.safe_dump(shape, sort_keys=False)


def in_structure(error: ConfigError) -> ConfigError:
    """The structure stage's refusal named as the combined config's key (``genome.grow`` → ``structure.grow``)."""
    where = error.yaml_path or ""
    if where == "genome" or where.startswith("genome."):
        where = STRUCTURE + where[len("genome"):]
    return ConfigError(error.message, hint=error.hint, yaml_path=where or None)


def recipe(parameters: Mapping[str, Any], shape: Mapping[str, Any], merged: str) -> list[dict[str, Any]]:
    """The chosen combined config: the parameter search's best ``parameters`` as the stage ``parameters``, then the
    structure search's best ``shape`` with its base (``merged``) read from that stage."""

    def named(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: named(v) for k, v in value.items()}
        if isinstance(value, list):
            return [named(v) for v in value]
        return PARAMETERS if value == merged else value

    return [{"name": PARAMETERS, **parameters}, named(dict(shape))]


def stage_of(store: Path) -> int:
    """The stage a combined search in ``store`` is in (an index of :data:`STAGES`), from its folders alone."""
    from resumerge.runs.evolve import storage

    if storage.is_storage(store / STRUCTURE):
        return 2
    if storage.progress(store / PARAMETERS).get("finished"):
        return 1
    return 0
