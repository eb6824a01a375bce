"""A model folder's tokenizer read with the ``tokenizers`` library alone (its tokenizer.json) and its chat template
rendered with jinja2, where transformers would load that same tokenizer unchanged: the token ids of a pass's texts
without importing transformers (about 2-2.5 CPU s of a check's start: transformers' import and ``AutoTokenizer``
parsing tokenizer.json in Python and again in Rust; bench/RESULTS.md, issue 72).

transformers 5 loads a tokenizer whose tokenizer_config.json names the plain class (``TokenizersBackend``, or
``PreTrainedTokenizerFast``, its alias) from tokenizer.json as it is, then adds the special tokens its configs name
that tokenizer.json does not hold, rewrites the post-processor where the config sets ``add_bos_token`` /
``add_eos_token``, and patches the pre-tokenizer of a vocabulary over 100,000 tokens it takes for Mistral's. Every
other class rebuilds the tokenizer in Python. So :func:`plain_tokenizer` answers only where none of that changes
anything: the plain class, tokenizer_config.json's keys among those that do not touch the ids, every special token
it or special_tokens_map.json names (and every ``added_tokens_decoder`` entry) already an added token of
tokenizer.json with the same settings, no padding or truncation in tokenizer.json, at most 100,000 tokens, one chat
template (chat_template.jinja, else the config's string) that needs no transformers extension; anywhere else None,
and the caller loads the tokenizer with transformers (:func:`resumerge.forward.text.texts.load_tokenizer`).

May import: resumerge.errors (nothing of resumerge's own; ``tokenizers`` and ``jinja2`` on use)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_EXTRA_TOKENS = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json's keys that change no token id of an encoded text or a rendered chat (the rest: transformers)
_INERT = frozenset({"backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only",
                    "clean_up_tokenization_spaces", "chat_template", "added_tokens_decoder", "model_input_names",
                    "padding_side", "truncation_side", *NAMED_TOKENS, *_EXTRA_TOKENS})
# transformers 5 patches a larger vocabulary's pre-tokenizer where it takes the model for one of Mistral's
MOST_TOKENS = 100_000
_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# transformers' own template extension (assistant masks): a template using it does not parse without it
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class PlainTokenizer:
    """A tokenizer.json's tokenizer and chat template, called as a pass calls transformers' tokenizer:
    ``tokenizer(text)["input_ids"]``, ``tokenizer.chat_template``, ``tokenizer.apply_chat_template(messages,
    tokenize=False)``, ``tokenizer.get_vocab()`` (how models of different vocabularies meet:
    :mod:`resumerge.forward.text.vocabs`)."""

    def __init__(self, backend: Any, template: str | None, specials: Mapping[str, str]) -> None:
        self.backend, self.chat_template, self.specials = backend, template, dict(specials)
        self._compiled: Any = None  # the template compiled at its first rendering, for every one after it

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)}

    def get_vocab(self) -> dict[str, int]:
        """Every token (the added ones too) by its id, as transformers' tokenizer of the plain class gives them."""
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], tokenize: bool = False) -> str:
        """``messages`` in the chat template, as text (``tokenize`` must be False: a pass tokenizes it itself),
        with the names transformers gives a template: the messages, no tools or documents, no generation prompt,
        and the named special tokens."""
        if tokenize or self.chat_template is None:
            raise ValueError("the plain tokenizer renders a chat template as text only")
        if self._compiled is None:
            self._compiled = _compiled(self.chat_template)
        return str(self._compiled.render(
            messages=[{k: v for k, v in m.items() if v is not None} for m in messages], tools=None, documents=None,
            add_generation_prompt=False, **self.specials))


def plain_tokenizer(directory: Path) -> PlainTokenizer | None:
    """The tokenizer of the model folder ``directory`` read without transformers, where transformers would give the
    same ids (see the module); None where it might not, or a file cannot be read."""
    config = json_object(directory / "tokenizer_config.json")
    if config is None or config.get("tokenizer_class") not in PLAIN_CLASSES or not set(config) <= _INERT:
        return None
    if (directory / "chat_template.json").exists() or (directory / "additional_chat_templates").exists():
        return None
    path = directory / "tokenizer.json"
    doc = json_object(path)
    if doc is None or doc.get("padding") is not None or doc.get("truncation") is not None:
        return None
    added = {entry.get("content"): entry for entry in doc.get("added_tokens") or () if isinstance(entry, dict)}
    specials = _specials(directory, config, added)
    template = _template(directory, config)
    if specials is None or isinstance(template, bool):
        return None
    try:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises a bare Exception for a file it cannot read: transformers says why
        return None
    if backend.get_vocab_size(with_added_tokens=True) > MOST_TOKENS:
        return None
    return PlainTokenizer(backend, template, specials)


def _specials(directory: Path, config: Mapping[str, Any], added: Mapping[Any, Mapping[str, Any]]
              ) -> dict[str, str] | None:
    """The named special tokens (``bos_token``: its text...) a template is given, where every special token the
    configs name is an added special token of tokenizer.json already, with the settings transformers would add it
    with (it adds each again, its settings replacing tokenizer.json's), and every ``added_tokens_decoder`` entry is
    tokenizer.json's own; else None."""
    named: dict[str, str] = {}
    for key in NAMED_TOKENS:
        value = config.get(key)
        if value is None:
            continue
        content = _special(value, added)
        if content is None:
            return None
        named[key] = content
    for key in _EXTRA_TOKENS:
        extra = config.get(key)
        if extra is not None and (not isinstance(extra, list) or any(_special(v, added) is None for v in extra)):
            return None
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return None
    by_id = {entry.get("id"): entry for entry in added.values()}
    for index, entry in decoder.items():
        theirs = by_id.get(int(index)) if str(index).isdigit() else None
        if not isinstance(entry, dict) or theirs is None or _settings(entry) != _settings(theirs):
            return None
    mapped = json_object(directory / "special_tokens_map.json")
    if mapped is None and (directory / "special_tokens_map.json").exists():
        return None
    for key, value in (mapped or {}).items():
        content = _special(value, added) if key in NAMED_TOKENS else None
        if content is None or named.get(key) != content:  # one the config does not name alike: transformers'
            return None
    return named


def _settings(token: Any) -> tuple[Any, ...]:
    """A token's settings as transformers adds it (a string: a special token, not normalized; a mapping: its own
    settings, the rest ``AddedToken``'s defaults)."""
    given = dict(token) if isinstance(token, Mapping) else {"content": token, "special": True}
    special = bool(given.get("special", False))
    defaults = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": not special}
    return tuple(given.get(flag, defaults.get(flag, special)) for flag in _TOKEN_FLAGS)


def _special(value: Any, added: Mapping[Any, Mapping[str, Any]]) -> str | None:
    """The text of the special token ``value`` (a string, or a token's settings) where tokenizer.json holds it as an
    added special token with the settings transformers gives it; else None."""
    given = dict(value) if isinstance(value, Mapping) else {"content": value}
    content = given.get("content")
    entry = added.get(content)
    if not isinstance(content, str) or entry is None or not entry.get("special"):
        return None
    return content if _settings({**given, "special": True}) == _settings(entry) else None


def _template(directory: Path, config: Mapping[str, Any]) -> str | bool | None:
    """The folder's one chat template (chat_template.jinja, which transformers prefers, else the config's string),
    None where it has none, False where it is one this module does not render as transformers does."""
    path = directory / "chat_template.jinja"
    try:
        if path.exists():
            with open(path, encoding="utf-8") as handle:  # text mode, as transformers reads it: "\r\n" -> "\n"
                found: Any = handle.read()
        else:
            found = config.get("chat_template")
    except (OSError, UnicodeDecodeError):
        return False
    if found is None:
        return None
    if not isinstance(found, str) or _GENERATION_TAG.search(found):
        return False
    return found


def _compiled(template: str) -> Any:
    """``template`` compiled in a sandbox, with the settings and names chat templates are written for (blocks
    trimmed, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None where there is none to read (a tokenizer folder's configs, read here and
    by :mod:`resumerge.forward.text.texts`)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
