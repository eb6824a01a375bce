"""What an extraction was asked to do, as one frozen object and the text recorded with the run.

The run's ledger and OUT's manifest keep a run's "config text"; for an extraction it is :func:`spec_text`'s
JSON document (marked by its ``extract_lora`` key), so ``resume`` and ``status`` rebuild the same plan from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from resumerge.errors import UsageError
from resumerge.runs.extract.state import EXTRACTION_MARK

_MARK = EXTRACTION_MARK
# The method name an extraction's plan carries (resumerge.runs.extract.planner.METHOD; here for callers that must not
# import torch to recognise one).
EXTRACTION_METHOD = "extract_lora"


@dataclass(frozen=True)
class ExtractSpec:
    """mergekit-extract-lora's options (same names and defaults), plus ``exact`` (the exact truncation instead
    of the randomized one)."""

    model: str
    base_model: str
    max_rank: int = 128
    sv_epsilon: float = 0.0
    distribute_scale: bool = True
    embed_lora: bool = False
    save_modules: tuple[str, ...] = ()
    exclude_regexes: tuple[str, ...] = ()
    include_regexes: tuple[str, ...] = ()
    skip_undecomposable: bool = False
    exact: bool = False
    # Ranks found for --sv-epsilon (module -> rank), recorded so a resume plans the very shapes again.
    ranks: tuple[tuple[str, int], ...] = field(default=())

    def command(self) -> str:
        """The command line that asks for this extraction (written in the model card)."""
        words = ["resumerge", "extract-lora", "--model", self.model, "--base-model", self.base_model,
                 "--out-path", "OUT", "--max-rank", str(self.max_rank)]
        if self.sv_epsilon:
            words += ["--sv-epsilon", repr(self.sv_epsilon)]
        if not self.distribute_scale:
            words.append("--no-distribute-scale")
        if self.embed_lora:
            words.append("--embed-lora")
        for name in self.save_modules:
            words += ["--save-module", name]
        for regex in self.exclude_regexes:
            words += ["-e", regex]
        for regex in self.include_regexes:
            words += ["-i", regex]
        if self.skip_undecomposable:
            words.append("--skip-undecomposable")
        if self.exact:
            words.append("--exact")
        return " ".join(_quote(w) for w in words)


def spec_text(spec: ExtractSpec) -> str:
    """The text recorded with the run: a JSON document that :func:`load_spec_text` reads back."""
    body: dict[str, Any] = asdict(spec)
    body["ranks"] = dict(spec.ranks)
    return json.dumps({_MARK: body}, indent=2, sort_keys=True) + "\n"


def load_spec_text(text: str) -> ExtractSpec:
    """The spec recorded by :func:`spec_text`; raises :class:`UsageError` when the text is not one."""
    try:
        body = json.loads(text)[_MARK]
        return ExtractSpec(
            model=str(body["model"]), base_model=str(body["base_model"]), max_rank=int(body["max_rank"]),
            sv_epsilon=float(body["sv_epsilon"]), distribute_scale=bool(body["distribute_scale"]),
            embed_lora=bool(body["embed_lora"]), save_modules=tuple(body["save_modules"]),
            exclude_regexes=tuple(body["exclude_regexes"]), include_regexes=tuple(body["include_regexes"]),
            skip_undecomposable=bool(body["skip_undecomposable"]), exact=bool(body["exact"]),
            ranks=tuple(sorted((str(k), int(v)) for k, v in body.get("ranks", {}).items())),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"the recorded extraction is unreadable ({exc})") from None


def _quote(word: str) -> str:
    return word if word and all(c.isalnum() or c in "-_./:@=+" for c in word) else json.dumps(word)
