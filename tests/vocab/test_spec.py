"""parse_tokenizer_spec: every accepted form, and each mistake reported at its YAML path."""

from __future__ import annotations

import re
from typing import Any

import pytest

from resumerge.errors import ConfigError
from resumerge.merge.vocab import TokenizerSpec, TokenSource, TokenSpec, parse_tokenizer_spec


def test_nothing_configured_builds_nothing() -> None:
    spec = parse_tokenizer_spec(None, None, None)
    assert spec == TokenizerSpec(source=None, source_yaml_path="tokenizer_source")
    assert not spec.builds
    assert parse_tokenizer_spec(None, None, "").chat_template is None  # mergekit ignores an empty template


def test_legacy_tokenizer_source() -> None:
    assert parse_tokenizer_spec("union", None, None).source == "union"
    spec = parse_tokenizer_spec(" org/model@v2 ", None, "chatml")
    assert (spec.source, spec.source_yaml_path, spec.chat_template) == ("org/model@v2", "tokenizer_source", "chatml")
    assert spec.builds
    assert spec.referenced_models() == ("org/model@v2",)


def test_section_defaults_to_union_and_keeps_token_order() -> None:
    section = {
        "pad_to_multiple_of": 64,
        "tokens": {
            "<|im_start|>": {"source": "org/chat"},
            "<|im_end|>": {"source": {"kind": "model_token", "model": "org/chat", "token": "</s>"}, "force": True},
            "<pad>": {"source": {"kind": "zero"}},
            "<x>": {"source": {"kind": "model_token", "model": "org/base", "token_id": 7}},
            "<y>": {},
            "<z>": None,
        },
    }
    spec = parse_tokenizer_spec(None, section, None)
    assert spec.source == "union" and spec.pad_to_multiple_of == 64 and spec.source_yaml_path == "tokenizer.source"
    assert spec.tokens == (
        TokenSpec("<|im_start|>", TokenSource("model", model="org/chat"), False, "tokenizer.tokens.<|im_start|>"),
        TokenSpec(
            "<|im_end|>",
            TokenSource("model_token", model="org/chat", token="</s>"),
            True,
            "tokenizer.tokens.<|im_end|>",
        ),
        TokenSpec("<pad>", TokenSource("zero"), False, "tokenizer.tokens.<pad>"),
        TokenSpec("<x>", TokenSource("model_token", model="org/base", token_id=7), False, "tokenizer.tokens.<x>"),
        TokenSpec("<y>", None, False, "tokenizer.tokens.<y>"),
        TokenSpec("<z>", None, False, "tokenizer.tokens.<z>"),
    )
    assert spec.referenced_models() == ("org/chat", "org/base")


@pytest.mark.parametrize(
    ("section", "message", "yaml_path"),
    [
        ({"tokens": {"t": {"source": {"kind": "model_token", "model": "m"}}}},
         "token_id or token must be specified", "tokenizer.tokens.t.source"),
        ({"tokens": {"t": {"source": {"kind": "model_token", "model": "m", "token": "a", "token_id": 1}}}},
         "only one of token_id or token may be specified", "tokenizer.tokens.t.source"),
        ({"tokens": {"t": {"source": {"kind": "model_token", "token": "a"}}}},
         "needs a model", "tokenizer.tokens.t.source.model"),
        ({"tokens": {"t": {"source": {"kind": "model_token", "model": "m", "token_id": -1}}}},
         "non-negative integer", "tokenizer.tokens.t.source.token_id"),
        ({"tokens": {"t": {"source": {"kind": "model_token", "model": "m", "token_id": True}}}},
         "non-negative integer", "tokenizer.tokens.t.source.token_id"),
        ({"tokens": {"t": {"source": {"kind": "model_token", "model": "m", "token": 3}}}},
         "token must be a string", "tokenizer.tokens.t.source.token"),
        ({"tokens": {"t": {"source": {"kind": "zero", "model": "m"}}}},
         "unknown key 'model'", "tokenizer.tokens.t.source.model"),
        ({"tokens": {"t": {"source": {"kind": "copy"}}}},
         "unknown source kind 'copy'", "tokenizer.tokens.t.source.kind"),
        ({"tokens": {"t": {"source": 5}}}, "model reference or a mapping", "tokenizer.tokens.t.source"),
        ({"tokens": {"t": {"source": "a@b@c"}}}, "Invalid model path - multiple @", "tokenizer.tokens.t.source"),
        ({"tokens": {"t": {"force": "yes", "source": "m"}}}, "force must be true or false", "tokenizer.tokens.t.force"),
        ({"tokens": {"t": {"force": True}}}, "force: true needs a source", "tokenizer.tokens.t.force"),
        ({"tokens": {"t": {"colour": 1}}}, "unknown key 'colour'", "tokenizer.tokens.t.colour"),
        ({"tokens": {"t": ["m"]}}, "must be a mapping", "tokenizer.tokens.t"),
        ({"tokens": {7: {}}}, "non-empty string", "tokenizer.tokens.7"),
        ({"tokens": ["t"]}, "tokens must be a mapping", "tokenizer.tokens"),
        ({"source": 5}, "must be 'union', 'base' or a model reference", "tokenizer.source"),
        ({"source": "x+y+z"}, "at most one '+adapter'", "tokenizer.source"),
        ({"pad_to_multiple_of": 0}, "positive integer", "tokenizer.pad_to_multiple_of"),
        ({"pad_to_multiple_of": 8.0}, "positive integer", "tokenizer.pad_to_multiple_of"),
        ({"sources": "union"}, "unknown key 'sources'", "tokenizer.sources"),
    ],
)
def test_section_mistakes(section: dict[str, Any], message: str, yaml_path: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        parse_tokenizer_spec(None, section, None)
    assert caught.value.yaml_path == yaml_path


def test_both_selectors_and_a_bad_chat_template() -> None:
    with pytest.raises(ConfigError, match="Cannot specify both tokenizer_source and tokenizer") as caught:
        parse_tokenizer_spec("base", {"source": "union"}, None)
    assert caught.value.yaml_path == "tokenizer"
    with pytest.raises(ConfigError, match=r"^chat_template: Invalid chat template: chatml2 — use auto, ") as bad:
        parse_tokenizer_spec(None, None, "chatml2")
    assert bad.value.yaml_path == "chat_template"
    with pytest.raises(ConfigError, match="multiple @") as src:
        parse_tokenizer_spec("a@b@c", None, None)
    assert src.value.yaml_path == "tokenizer_source"


def test_public_names_are_exported_and_sorted() -> None:
    import resumerge.merge.vocab as vocab

    assert vocab.__all__ == sorted(vocab.__all__)
    assert all(hasattr(vocab, name) for name in vocab.__all__)
