"""Model references as mergekit writes them: ``path_or_hub_id[@revision][+lora_path_or_hub_id[@revision]]``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelRef:
    """A model input: local path or hub id, optional revision, optional LoRA adapter, optional architecture.

    ``key`` is the canonical string used in plans, fingerprints and messages.
    """

    path: str
    revision: str | None = None
    lora: ModelRef | None = None
    override_architecture: str | None = None

    @property
    def key(self) -> str:
        """Canonical text of the reference (``path@rev+lora@rev``)."""
        text = self.path if self.revision is None else f"{self.path}@{self.revision}"
        if self.lora is not None:
            text += "+" + self.lora.key
        return text

    def __str__(self) -> str:
        return self.key


def parse_model_ref(text: str) -> ModelRef:
    """Parse mergekit's string form. Raises ``ValueError`` with mergekit's wording for malformed text.

    The string is split on ``+`` first (at most once), then each part on ``@`` (at most once).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a model reference must be a non-empty string")
    parts = text.strip().split("+")
    if len(parts) > 2:
        raise ValueError(f"Can't parse {text!r}: at most one '+adapter' is allowed")
    model = _path_and_revision(parts[0], text)
    if len(parts) == 2:
        return ModelRef(model.path, model.revision, lora=_path_and_revision(parts[1], text))
    return model


def _path_and_revision(part: str, whole: str) -> ModelRef:
    pieces = part.split("@")
    if len(pieces) > 2:
        raise ValueError(f"Invalid model path - multiple @: {whole!r}")
    if not pieces[0]:
        raise ValueError(f"Can't parse {whole!r}: empty model path")
    if len(pieces) == 2:
        if not pieces[1]:
            raise ValueError(f"Can't parse {whole!r}: empty revision after '@'")
        return ModelRef(pieces[0], pieces[1])
    return ModelRef(pieces[0])
