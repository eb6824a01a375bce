"""What an extraction asks of the modules transformers builds from the base's config.json (its renamings on load,
each module's kind, the parameters modules hold of their own), read once per config and installed transformers and
kept among transformers' answers in resumerge's cache (:mod:`resumerge.merge.plan.keptfacts`).

Building them imports transformers (about 3 s of CPU, and half a gigabyte, on the bench's machine) for a model
built on the meta device in a fraction of a second: every ``extract-lora`` and every ``resume`` of one re-plans, so
each paid the import for the same answer. The cache holds only answers transformers gave; where it is missing, cannot
build the family or its import fails, nothing is kept (installing or fixing it then takes effect at once). A cache
file that cannot be read is ignored; a lost or torn write costs one build, never a wrong answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.merge.plan.expertmodules import meta_model
from resumerge.merge.plan.keptfacts import installed, keep, kept

# The question's name among the kept answers; bumped whenever what is kept (or how it is read from the model)
# changes: an older answer is then never read.
_QUESTION = "module-views"


@dataclass(frozen=True)
class ModelModules:
    """The modules of a model transformers builds: ``renames`` (each pattern of its conversion mapping with its
    flags, and the name it renames to), ``kinds`` (module path -> its class name, and whether PEFT gives it LoRA
    factors: a ``torch.nn`` linear, embedding or convolution layer; a module shared by two paths under each),
    ``paths`` (every module's first path, as ``named_modules`` lists them), ``embeddings`` (the ``nn.Embedding``
    paths), ``owners`` (module path -> its parameters other than ``weight`` and ``bias``)."""

    renames: tuple[tuple[str, int, str], ...]
    kinds: Mapping[str, tuple[str, bool]]
    paths: frozenset[str]
    embeddings: frozenset[str]
    owners: Mapping[str, tuple[str, ...]]

    def patterns(self) -> list[tuple[re.Pattern[str], str]]:
        """The renamings as :func:`~resumerge.merge.plan.expertmodules.renamed` applies them."""
        return [(re.compile(pattern, flags), target) for pattern, flags, target in self.renames]


def model_modules(config: Mapping[str, Any], cache_dir: Path | None = None) -> ModelModules | None:
    """The :class:`ModelModules` of the model transformers builds from ``config``, from the cache in ``cache_dir``
    (default :func:`~resumerge.config.locations.cache_root`) or built now (and kept); None where transformers is
    missing or cannot build it."""
    versions = installed()
    if versions is None:
        return None
    known, answer = kept(_QUESTION, config, versions, cache_dir)
    found = _read(answer) if known else None
    if found is not None:
        return found
    found = _built(config)
    if found is not None:
        keep(_QUESTION, config, versions, _doc(found), cache_dir)
    return found


def _built(config: Mapping[str, Any]) -> ModelModules | None:
    built = meta_model(config)
    if built is None:
        return None
    model, _, renames = built
    import torch

    lora_types = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    kinds = {path: (type(module).__name__, isinstance(module, lora_types))
             for path, module in model.named_modules(remove_duplicate=False)}
    paths = frozenset(n for n, _ in model.named_modules())
    embeddings = frozenset(n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding))
    owners: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("weight", "bias"):
            owners.setdefault(module, []).append(leaf)
    return ModelModules(tuple((p.pattern, p.flags, target) for p, target in renames), kinds, paths, embeddings,
                        {k: tuple(v) for k, v in owners.items()})


def _read(doc: Any) -> ModelModules | None:
    try:
        return ModelModules(tuple((str(p), int(f), str(t)) for p, f, t in doc["renames"]),
                            {str(k): (str(c), bool(lora)) for k, (c, lora) in doc["kinds"].items()},
                            frozenset(str(p) for p in doc["paths"]),
                            frozenset(str(e) for e in doc["embeddings"]),
                            {str(k): tuple(str(x) for x in v) for k, v in doc["owners"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):  # another form: built again
        return None


def _doc(found: ModelModules) -> dict[str, Any]:
    return {"renames": [list(r) for r in found.renames], "kinds": {k: list(v) for k, v in found.kinds.items()},
            "paths": sorted(found.paths), "embeddings": sorted(found.embeddings),
            "owners": {k: list(v) for k, v in found.owners.items()}}
