"""The model an adapter is loaded onto, as PEFT sees it: the modules transformers builds from the base's config.json.

PEFT names an adapter's tensors by those modules (``base_model.model.<module>.lora_A.weight``), never by the
checkpoint's names, which transformers may rename on load (Nemotron-H's ``backbone.`` is ``model.``): an adapter
named by the checkpoint loads with its factors silently dropped. It wraps a module that is an ``nn.Embedding``
(Gemma 4's ``embed_tokens_per_layer`` as much as ``embed_tokens``) as an embedding, whose factors are
``lora_embedding_A/B``; it matches ``modules_to_save`` entries by the end of each module's name (``conv`` is LFM2's
``ShortConv`` as well as the ``conv`` inside it), so an entry must be a suffix no other module ends with; and a
parameter of a module's own (Mamba's ``A_log``, ``D``, ``dt_bias``) it can only save with its whole module.

Without transformers, or for a family it cannot build, the view keeps the checkpoint's names and knows no more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resumerge.merge.plan.expertmodules import renamed
from resumerge.runs.extract.modelview import model_modules


@dataclass(frozen=True)
class PeftView:
    """What PEFT sees: the model's name of each checkpoint module (``renames``), its embedding modules, every module
    path, and the modules holding parameters of their own besides ``weight`` and ``bias`` (by module path)."""

    renames: tuple[tuple[Any, str], ...] = ()
    embeddings: frozenset[str] = frozenset()
    paths: frozenset[str] = frozenset()
    owners: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def name(self, module: str) -> str:
        """The model's name of checkpoint module ``module``."""
        return renamed(f"{module}.weight", list(self.renames)).removesuffix(".weight") if self.renames else module

    def owner(self, module: str) -> str | None:
        """The module holding parameters of its own that ``module`` (a model name) is, or is inside."""
        return next((o for o in self.owners if module == o or module.startswith(o + ".")), None)

    def suffixes(self, modules: Iterable[str], saved: Iterable[str]) -> list[str]:
        """``modules_to_save`` entries for the model names ``modules`` (one kind of module, saved whole with the
        others of ``saved``): the shortest end they share that no other module ends with (PEFT matches an entry by
        the end of a module's name), else each one's own shortest such end; their last component when the view
        knows no modules."""
        inside = set(saved)
        names = sorted(set(modules))

        def clean(end: str) -> bool:
            return all(p in inside or not p.endswith(end) for p in self.paths)

        def shortest(of: list[str]) -> str | None:
            parts = of[0].split(".")
            for k in range(1, len(parts) + 1):
                end = ".".join(parts[-k:])
                if all(n.endswith(end) for n in of) and clean(end):
                    return end
            return None

        common = shortest(names)
        if common is not None:
            return [common]
        return [shortest([n]) or n for n in names]


def peft_view(config: Mapping[str, Any]) -> PeftView:
    """The view of the model transformers builds from ``config`` (module docstring)."""
    modules = model_modules(config)
    if modules is None:
        return PeftView()
    return PeftView(tuple(modules.patterns()), modules.embeddings, modules.paths, modules.owners)
