"""The validated tokenizer section of a config: where the output vocabulary comes from and how rows are filled.

mergekit reads three keys for this (``tokenizer_source``, ``tokenizer: {source, tokens, pad_to_multiple_of}``,
``chat_template``); :func:`parse_tokenizer_spec` turns them into one frozen :class:`TokenizerSpec` or raises a
:class:`~resumerge.errors.ConfigError` whose ``yaml_path`` names the offending entry
(``tokenizer.tokens.<|im_start|>.source``). Model references are stored as their canonical key
(:attr:`resumerge.config.modelref.ModelRef.key`), so they compare equal to the keys the planner uses for inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from resumerge.config.merge_config import unknown_key_error
from resumerge.config.modelref import parse_model_ref
from resumerge.errors import ConfigError
from resumerge.merge.vocab.chat import check_chat_template

TokenSourceKind = Literal["model", "model_token", "zero"]


@dataclass(frozen=True)
class TokenSource:
    """Where a configured token's embedding row comes from when one is needed.

    ``kind`` is ``model`` (the row of this token in ``model``), ``model_token`` (the row of another token of
    ``model``, named by ``token`` or by ``token_id``) or ``zero`` (a row of zeros).
    """

    kind: TokenSourceKind
    model: str | None = None
    token: str | None = None
    token_id: int | None = None


@dataclass(frozen=True)
class TokenSpec:
    """One entry of ``tokenizer.tokens``: the token text, its row source (None: the automatic rules) and ``force``.

    ``force`` makes every model use the configured row, even models that have the token themselves.
    """

    token: str
    source: TokenSource | None
    force: bool
    yaml_path: str


@dataclass(frozen=True)
class TokenizerSpec:
    """Validated tokenizer settings of a merge.

    ``source`` is ``"base"``, ``"union"``, a model key, or None when no tokenizer is built (the donor's files are
    copied, with ``chat_template`` applied if set). ``tokens`` keeps the YAML order, which decides the ids of
    tokens that are added. ``chat_template`` is ``"auto"``, a built-in name or a literal Jinja template.
    ``source_yaml_path`` is where ``source`` was written (``tokenizer_source`` or ``tokenizer.source``).
    """

    source: str | None = None
    tokens: tuple[TokenSpec, ...] = ()
    pad_to_multiple_of: int | None = None
    chat_template: str | None = None
    source_yaml_path: str = "tokenizer.source"

    @property
    def builds(self) -> bool:
        """True when a new tokenizer (and permuted embeddings) must be built rather than copied."""
        return self.source is not None

    def referenced_models(self) -> tuple[str, ...]:
        """Every model key the spec names (tokenizer source and token sources), first mention first."""
        keys: list[str] = []
        if self.source not in (None, "base", "union"):
            keys.append(str(self.source))
        keys.extend(t.source.model for t in self.tokens if t.source is not None and t.source.model is not None)
        return tuple(dict.fromkeys(keys))


def parse_tokenizer_spec(
    tokenizer_source: str | None,
    tokenizer_section: Mapping[str, Any] | None,
    chat_template: str | None,
) -> TokenizerSpec:
    """Validate the three tokenizer keys of a config and return them as a :class:`TokenizerSpec`.

    A ``tokenizer:`` section without ``source`` means ``union`` (mergekit's default). Raises :class:`ConfigError`
    for both keys at once, a malformed source, token entry or ``pad_to_multiple_of``, and an invalid
    ``chat_template`` (mergekit's ``Invalid chat template: <x>``).
    """
    chat_template = chat_template or None  # mergekit treats an empty template as none
    if chat_template is not None:
        check_chat_template(chat_template)
    if tokenizer_source is not None and tokenizer_section is not None:
        raise ConfigError("Cannot specify both tokenizer_source and tokenizer", yaml_path="tokenizer")
    if tokenizer_section is None:
        source = _source(tokenizer_source, "tokenizer_source") if tokenizer_source is not None else None
        return TokenizerSpec(source=source, chat_template=chat_template, source_yaml_path="tokenizer_source")
    if not isinstance(tokenizer_section, Mapping):
        raise ConfigError("tokenizer must be a mapping", yaml_path="tokenizer")
    extra = sorted(str(k) for k in tokenizer_section if k not in ("source", "tokens", "pad_to_multiple_of"))
    if extra:
        raise unknown_key_error(extra[0], f"tokenizer.{extra[0]}")
    raw_source = tokenizer_section.get("source")
    source = "union" if raw_source is None else _source(raw_source, "tokenizer.source")
    pad = tokenizer_section.get("pad_to_multiple_of")
    if pad is not None and (type(pad) is not int or pad <= 0):
        raise ConfigError("pad_to_multiple_of must be a positive integer", yaml_path="tokenizer.pad_to_multiple_of")
    return TokenizerSpec(
        source=source,
        tokens=_tokens(tokenizer_section.get("tokens")),
        pad_to_multiple_of=pad,
        chat_template=chat_template,
    )


def _source(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"{path} must be 'union', 'base' or a model reference string, got {type(value).__name__}",
            yaml_path=path,
        )
    if value in ("union", "base"):
        return value
    return _model_key(value, path)


def _model_key(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected a model reference string, got {type(value).__name__}", yaml_path=path)
    try:
        return parse_model_ref(value).key
    except ValueError as exc:
        raise ConfigError(str(exc), yaml_path=path) from None


def _tokens(value: Any) -> tuple[TokenSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError("tokens must be a mapping from token text to settings", yaml_path="tokenizer.tokens")
    specs = []
    for token, entry in value.items():
        if not isinstance(token, str) or not token:
            raise ConfigError(
                f"token {token!r} must be a non-empty string (quote it in YAML)", yaml_path=f"tokenizer.tokens.{token}"
            )
        path = f"tokenizer.tokens.{token}"
        if entry is None:
            entry = {}
        if not isinstance(entry, Mapping):
            raise ConfigError("a token entry must be a mapping with 'source' and/or 'force'", yaml_path=path)
        extra = sorted(str(k) for k in entry if k not in ("source", "force"))
        if extra:
            raise unknown_key_error(extra[0], f"{path}.{extra[0]}")
        force = entry.get("force", False)
        if type(force) is not bool:
            raise ConfigError("force must be true or false", yaml_path=f"{path}.force")
        source = _token_source(entry.get("source"), f"{path}.source")
        if force and source is None:
            # mergekit fails late (NotImplementedError) on a forced token without a source: say so up front.
            raise ConfigError("force: true needs a source for the token's row", yaml_path=f"{path}.force")
        specs.append(TokenSpec(token=token, source=source, force=force, yaml_path=path))
    return tuple(specs)


def _token_source(value: Any, path: str) -> TokenSource | None:
    if value is None:
        return None
    if isinstance(value, str):
        return TokenSource("model", model=_model_key(value, path))
    if not isinstance(value, Mapping):
        raise ConfigError("source must be a model reference or a mapping with 'kind'", yaml_path=path)
    kind = value.get("kind")
    if kind == "zero":
        extra = sorted(str(k) for k in value if k != "kind")
        if extra:
            raise unknown_key_error(extra[0], f"{path}.{extra[0]}", where=" for kind: zero")
        return TokenSource("zero")
    if kind == "model_token":
        extra = sorted(str(k) for k in value if k not in ("kind", "model", "token", "token_id"))
        if extra:
            raise unknown_key_error(extra[0], f"{path}.{extra[0]}", where=" for kind: model_token")
        if value.get("model") is None:
            raise ConfigError("kind: model_token needs a model", yaml_path=f"{path}.model")
        model = _model_key(value["model"], f"{path}.model")
        token, token_id = value.get("token"), value.get("token_id")
        if token is None and token_id is None:
            raise ConfigError("token_id or token must be specified", yaml_path=path)
        if token is not None and token_id is not None:
            raise ConfigError("only one of token_id or token may be specified", yaml_path=path)
        if token is not None and not isinstance(token, str):
            raise ConfigError("token must be a string", yaml_path=f"{path}.token")
        if token_id is not None and (type(token_id) is not int or token_id < 0):
            raise ConfigError("token_id must be a non-negative integer", yaml_path=f"{path}.token_id")
        return TokenSource("model_token", model=model, token=token, token_id=token_id)
    raise ConfigError(
        f"unknown source kind {kind!r}",
        yaml_path=f"{path}.kind",
        hint="use a model reference, {kind: model_token, model, token | token_id} or {kind: zero}",
    )
