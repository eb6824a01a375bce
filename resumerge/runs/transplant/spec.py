"""What a transplant was asked to do, as one frozen object and the text recorded with the run.

The run's ledger and OUT's manifest keep a run's "config text"; a transplant's is :func:`spec_text`'s JSON document
(marked by its ``tokensurgeon`` key), so ``resume``, ``status`` and ``plan`` rebuild the same plan from it.
Standard library only: the API recognises a transplant's text without importing torch.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from resumerge.config.transplantmark import TRANSPLANT_MARK
from resumerge.errors import UsageError

MARK = TRANSPLANT_MARK
# mergekit-tokensurgeon 0.1.5's --approximation-method choices that resumerge computes.
METHODS = ("omp", "common_interpolation", "subword", "mean", "zero", "randn", "john_hewitt", "landmark_pca", "stb",
           "mp_rope")
WEIGHT_SCHEMES = ("distance_proportional", "barycentric", "least_squares")
SUBWORD_METHODS = ("mean", "sum", "weighted_mean", "first_last")
# --prefix-match / --byte-match: which of the two matrices the match applies to (its own definition: ``embed`` the
# token embedding, ``lm_head`` the head; 0.1.5 swaps the two, see tokens.allowed).
MATCH_CHOICES = ("yes", "no", "embed", "lm_head")
# The methods whose rows depend on k (atoms or neighbours).
USES_K = ("omp", "common_interpolation", "stb", "mp_rope")


@dataclass(frozen=True)
class SurgeryChoices:
    """mergekit-tokensurgeon 0.1.5's options (same names, defaults and meanings), written here once: the API's
    option group (:class:`resumerge.api.options.Surgery`) is this, and :class:`SurgerySpec` adds the two models."""

    approximation_method: str = "omp"
    k: int = 64
    cosine_similarity: bool = False
    weight_scheme: str = "distance_proportional"
    subword_method: str = "mean"
    batch_size: int = 512
    prefix_match: str = "no"
    byte_match: str = "no"
    magikarp: bool = False
    new_vocab_noise: float | None = None
    new_vocab_scale: float | None = None


@dataclass(frozen=True, kw_only=True)
class SurgerySpec(SurgeryChoices):
    """A transplant: MODEL given DONOR's tokenizer, with the options of :class:`SurgeryChoices`."""

    model: str
    donor: str

    def command(self, flags: Sequence[str] = ()) -> str:
        """The command line that asks for this transplant (written in the model card), with ``flags`` (the run's
        output flags, :func:`~resumerge.runs.transplant.planner.output_flags`) after the transplant's own; each word
        quoted as a shell reads it."""
        words = ["resumerge", "tokensurgeon", self.model, self.donor, "OUT", "-a", self.approximation_method]
        defaults = SurgerySpec(model="", donor="")
        for each in fields(self):
            value = getattr(self, each.name)
            if each.name in ("model", "donor", "approximation_method") or value == getattr(defaults, each.name):
                continue
            flag = "--" + each.name.replace("_", "-")
            if isinstance(value, bool):
                words.append(flag if value else "--no-" + flag[2:])
            else:
                words += [flag, str(value)]
        return " ".join(shlex.quote(word) for word in [*words, *flags])

    def describe(self) -> str:
        """The method as the log, ``status`` and the card name it: ``omp (k=64)``."""
        method = self.approximation_method
        if method == "common_interpolation":
            metric = "cosine" if self.cosine_similarity else "euclidean"
            return f"{method} (k={self.k}, {self.weight_scheme} weights, {metric} distance)"
        if method in ("omp", "stb", "mp_rope"):
            return f"{method} (k={self.k})"
        if method == "subword":
            return f"subword ({self.subword_method})"
        return method


def check_spec(spec: SurgerySpec) -> None:
    """Refuse options that cannot work (UsageError, exit 2), before any model is opened."""
    choices = {"approximation_method": METHODS, "weight_scheme": WEIGHT_SCHEMES, "subword_method": SUBWORD_METHODS,
               "prefix_match": MATCH_CHOICES, "byte_match": MATCH_CHOICES}
    for name, allowed in choices.items():
        if getattr(spec, name) not in allowed:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be one of {', '.join(allowed)}, got {getattr(spec, name)!r}")
    if spec.k <= 0:
        raise UsageError(f"-k must be at least 1, got {spec.k}")
    if spec.new_vocab_noise is not None and spec.new_vocab_noise < 0:
        raise UsageError(f"--new-vocab-noise must not be negative, got {spec.new_vocab_noise}")
    if spec.model == spec.donor:
        raise UsageError("MODEL and DONOR are the same model: there is no other tokenizer to transplant")


def spec_text(spec: SurgerySpec) -> str:
    """The text recorded with the run: a JSON document that :func:`load_spec_text` reads back."""
    return json.dumps({MARK: asdict(spec)}, indent=2, sort_keys=True) + "\n"


def load_spec_text(text: str) -> SurgerySpec:
    """The spec recorded by :func:`spec_text`; raises :class:`UsageError` when the text is not one."""
    try:
        body: dict[str, Any] = json.loads(text)[MARK]
        known = {each.name for each in fields(SurgerySpec)}
        return SurgerySpec(**{k: v for k, v in body.items() if k in known})
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"the recorded transplant is unreadable ({exc})") from None


def stage_of(doc: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A recipe document that transplants (``tokensurgeon: {model: A, donor: B, <option>: value, ...}`` beside
    ``name``; options as :class:`SurgeryChoices` names them): (its recorded text, the passthrough config over
    MODEL and DONOR that lists them as the stage's models). None for any other document; ConfigError (exit 2)
    for a bad one."""
    from resumerge.errors import ConfigError

    body = doc.get(MARK)
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ConfigError("tokensurgeon must be a mapping of model, donor and the transplant's options",
                          yaml_path=MARK)
    others = sorted(set(doc) - {MARK, "name"})
    if others:
        raise ConfigError(f"a tokensurgeon stage holds only name and tokensurgeon, not {', '.join(others)}",
                          yaml_path=others[0], hint="merge the transplanted model in a stage of its own")
    known = {each.name for each in fields(SurgerySpec)}
    for key in body:
        if key not in known:
            raise ConfigError(f"unknown tokensurgeon option {key!r}", yaml_path=f"{MARK}.{key}",
                              hint=f"one of {', '.join(sorted(known))}")
    for key in ("model", "donor"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise ConfigError(f"tokensurgeon needs {key}: a model path or hub id", yaml_path=f"{MARK}.{key}")
    try:
        spec = SurgerySpec(**body)
        check_spec(spec)
    except (TypeError, UsageError) as exc:
        raise ConfigError(str(exc), yaml_path=MARK) from None
    config: dict[str, Any] = {"merge_method": "passthrough", "base_model": spec.model,
                              "models": [{"model": spec.model}, {"model": spec.donor}]}
    if "name" in doc:
        config["name"] = doc["name"]
    return spec_text(spec), config
