"""Model references as mergekit writes them: ``path_or_hub_id[@revision][+lora[@revision]]``.

Pure string and mapping parsing, no file or network access except :func:`is_local`, which looks at the disk.
The rules follow mergekit's ``ModelPath`` / ``ModelReference`` (``mergekit/common.py``): split on ``+`` first
(at most one), then each part on ``@`` (at most one). The mapping form is
``{model: str | {path, revision}, lora: ..., override_architecture: str}``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from resumerge.errors import ConfigError


@dataclass(frozen=True)
class ModelRef:
    """One model reference: a local directory or a hub repo id, an optional revision and LoRA adapter.

    ``revision`` is ``None`` when the reference names none (the hub's default branch, ``main``); an empty
    revision (``org/name@``) is normalised to ``None`` as in mergekit. ``lora`` never has a ``lora`` itself.
    """

    path: str
    revision: str | None = None
    lora: ModelRef | None = None
    override_architecture: str | None = None

    def __str__(self) -> str:
        """Render the reference back into mergekit's string form (without ``override_architecture``)."""
        text = f"{self.path}@{self.revision}" if self.revision else self.path
        return f"{text}+{self.lora}" if self.lora is not None else text

    @property
    def base(self) -> ModelRef:
        """The model part alone: same path and revision, no LoRA, no architecture override."""
        return ModelRef(self.path, self.revision)


def parse_model_ref(value: str | Mapping[str, object], *, yaml_path: str | None = None) -> ModelRef:
    """Parse a model reference in mergekit's string or mapping form.

    Returns a :class:`ModelRef`. Raises :class:`~resumerge.errors.ConfigError` (with ``yaml_path``) for more
    than one ``+``, more than one ``@`` in a part, an empty path, or a mapping without a usable ``model``.
    Whether the path exists or is a valid hub id is not checked here (see :func:`is_local` and the resolver).
    """
    if isinstance(value, str):
        chunks = value.split("+")
        if len(chunks) > 2:
            raise ConfigError(
                f"invalid model reference {value!r}: more than one '+'",
                hint="write MODEL[@REVISION][+LORA[@REVISION]]",
                yaml_path=yaml_path,
            )
        model = _parse_path(chunks[0], value, yaml_path)
        lora = _parse_path(chunks[1], value, yaml_path) if len(chunks) == 2 else None
        return ModelRef(model.path, model.revision, lora)
    if isinstance(value, Mapping):
        return _parse_mapping(value, yaml_path)
    raise ConfigError(
        f"a model reference must be a string or a mapping, not {type(value).__name__}", yaml_path=yaml_path
    )


def is_local(ref: ModelRef) -> bool:
    """Return whether ``ref.path`` exists on disk, in which case it is used as-is and never looked up on the hub.

    This is mergekit's rule: anything that is not an existing path is a hub repo id.
    """
    return os.path.exists(os.path.expanduser(ref.path))


def _parse_path(text: str, whole: str, yaml_path: str | None) -> ModelRef:
    if text.count("@") > 1:
        raise ConfigError(
            f"invalid model reference {whole!r}: more than one '@' in {text!r}",
            hint="write MODEL[@REVISION][+LORA[@REVISION]]",
            yaml_path=yaml_path,
        )
    path, _, revision = text.partition("@")
    if not path.strip():
        raise ConfigError(f"invalid model reference {whole!r}: the model path is empty", yaml_path=yaml_path)
    return ModelRef(path, revision or None)


def _parse_mapping(value: Mapping[str, object], yaml_path: str | None) -> ModelRef:
    unknown = set(value) - {"model", "lora", "override_architecture"}
    if unknown:
        raise ConfigError(
            f"unknown key(s) in model reference: {', '.join(sorted(unknown))}",
            hint="allowed: model, lora, override_architecture",
            yaml_path=yaml_path,
        )
    if "model" not in value:
        raise ConfigError("a model reference mapping needs a 'model' key", yaml_path=yaml_path)
    model = _path_from(value["model"], yaml_path)
    lora = _path_from(value["lora"], yaml_path) if value.get("lora") is not None else None
    arch = value.get("override_architecture")
    if arch is not None and not isinstance(arch, str):
        raise ConfigError("override_architecture must be a string", yaml_path=yaml_path)
    return ModelRef(model.path, model.revision, lora, arch)


def _path_from(value: object, yaml_path: str | None) -> ModelRef:
    """One ``ModelPath``: a ``path[@revision]`` string or a ``{path, revision}`` mapping."""
    if isinstance(value, str):
        return _parse_path(value, value, yaml_path)
    if isinstance(value, Mapping) and isinstance(value.get("path"), str) and value["path"]:
        revision = value.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ConfigError("a model revision must be a string", yaml_path=yaml_path)
        return ModelRef(value["path"], revision or None)
    raise ConfigError(
        "a model path must be 'path[@revision]' or a mapping with 'path' and optional 'revision'",
        yaml_path=yaml_path,
    )
