"""Chat templates: validating ``chat_template:``, resolving it to Jinja text, and writing it into tokenizer files.

mergekit's rule (``merge.py`` ``_set_chat_template``): ``auto`` picks the most common template among the input
models' tokenizers; a short name without ``{`` or a newline is a built-in; anything else must look like Jinja
(at least 20 characters and a ``{``), else ``Invalid chat template: <x>``.

A template is written twice, to the same text: as ``chat_template`` in ``tokenizer_config.json`` (read by every
transformers version) and as ``chat_template.jinja`` (what transformers 5 saves, and which it prefers over the
config entry, so a donor's stale ``.jinja`` file must never survive next to a new template).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab.builtin_templates import BUILTIN_TEMPLATES

AUTO = "auto"
CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"


def check_chat_template(template: str) -> None:
    """Raise :class:`ConfigError` (yaml_path ``chat_template``) unless ``template`` is auto, a built-in or Jinja."""
    if template == AUTO or _builtin_name(template) is not None:
        return
    if len(template) < 20 or "{" not in template:
        shown = template if len(template) <= 80 else template[:77] + "..."
        raise ConfigError(
            f"Invalid chat template: {shown}",
            yaml_path="chat_template",
            hint=f"use auto, one of {', '.join(sorted(BUILTIN_TEMPLATES))}, or a Jinja template",
        )


def resolve_chat_template(template: str, directories: Iterable[Path]) -> str | None:
    """Return the Jinja text that ``chat_template: template`` stands for.

    ``auto`` reads the template of each directory (in the given order) and returns the most common one, ties going
    to the first seen, or None when no input has one (the output then keeps whatever its tokenizer had). A
    built-in name returns resumerge's text for it; a literal template returns itself. Raises :class:`ConfigError`
    for an invalid value.
    """
    check_chat_template(template)
    if template == AUTO:
        found = [t.strip() for t in (read_chat_template(d) for d in directories) if t is not None and t.strip()]
        if not found:
            return None
        # Counter keeps first-insertion order among equal counts, so a tie goes to the earliest input.
        return Counter(found).most_common(1)[0][0]
    name = _builtin_name(template)
    return BUILTIN_TEMPLATES[name] if name is not None else template


def read_chat_template(directory: Path) -> str | None:
    """The default chat template transformers would load from a tokenizer directory, or None.

    ``chat_template.jinja`` wins over the ``chat_template`` entry of ``tokenizer_config.json``; named templates
    (a list in the config, or ``chat_templates/*.jinja``) contribute their ``default`` one. A directory without
    tokenizer files, or with unreadable ones, has none (mergekit skips tokenizers it cannot load).
    """
    config_path = directory / CONFIG_FILE
    if not config_path.is_file() and not (directory / "tokenizer.json").is_file():
        return None
    jinja = directory / JINJA_FILE
    extras = directory / "chat_templates"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if extras.is_dir() and any(extras.glob("*.jinja")):
        return None  # named templates without a default one
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def apply_chat_template(tokenizer_config: bytes, template: str, *, path: str | None = None) -> bytes:
    """Return ``tokenizer_config`` (JSON bytes) with its ``chat_template`` set to ``template``.

    Key order is kept; the result is 2-space-indented UTF-8 JSON ending in a newline, so the same inputs always give
    the same bytes. Raises :class:`ModelInputError` (naming ``path``) if the bytes are not a JSON object.
    """
    config = load_json_object(tokenizer_config, path or CONFIG_FILE)
    config["chat_template"] = template
    return dump_json(config)


def apply_chat_template_files(files: Sequence[tuple[str, bytes]], template: str) -> tuple[tuple[str, bytes], ...]:
    """Set ``template`` in a set of tokenizer files (name, bytes) and return the new set, sorted by name.

    ``tokenizer_config.json`` gets the template (it is created holding only the template if absent),
    ``chat_template.jinja`` is written (replacing a donor's), and an existing ``chat_template.json`` (processor
    format) gets its ``chat_template`` entry replaced. Other files are returned unchanged.
    """
    out = dict(files)
    out[CONFIG_FILE] = apply_chat_template(out.get(CONFIG_FILE, b"{}"), template)
    out[JINJA_FILE] = template.encode("utf-8")
    if PROCESSOR_TEMPLATE_FILE in out:
        processor = load_json_object(out[PROCESSOR_TEMPLATE_FILE], PROCESSOR_TEMPLATE_FILE)
        processor["chat_template"] = template
        out[PROCESSOR_TEMPLATE_FILE] = dump_json(processor)
    return tuple(sorted(out.items()))


def load_json_object(data: bytes, path: str) -> dict[str, Any]:
    """Parse ``data`` as a JSON object; raises :class:`ModelInputError` naming ``path`` otherwise."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelInputError(f"{path} is not valid JSON: {exc}", path=path) from None
    if not isinstance(value, dict):
        raise ModelInputError(f"{path} must hold a JSON object, not {type(value).__name__}", path=path)
    return value


def dump_json(value: Any) -> bytes:
    """Deterministic JSON bytes: 2-space indent, key order as given, UTF-8, trailing newline.

    Falls back to ASCII escapes when a string holds a lone surrogate, which UTF-8 cannot encode.
    """
    try:
        return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(value, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def _builtin_name(template: str) -> str | None:
    # mergekit only looks a name up when it cannot be Jinja: short, one line, no brace.
    if len(template) < 256 and "\n" not in template and "{" not in template and template in BUILTIN_TEMPLATES:
        return template
    return None
