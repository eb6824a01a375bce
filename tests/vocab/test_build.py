"""build_tokenizer: output vocabularies and files, determinism, loading in transformers, and input errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import transformers

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab import (
    BUILTIN_TEMPLATES,
    BuiltTokenizer,
    MissingToken,
    VocabInput,
    build_tokenizer,
    missing_rows_report,
    parse_tokenizer_spec,
)
from tests.vocab.conftest import Trio, make_trio

ROOT = Path(__file__).resolve().parents[2]


def _build(trio: Trio, section: dict[str, object], base: str | None = None, template: str | None = None,
           keys: list[str] | None = None) -> BuiltTokenizer:
    spec = parse_tokenizer_spec(None, section, template)
    return build_tokenizer(spec, trio.inputs(keys), base)


def _vocab(files: dict[str, bytes]) -> dict[str, int]:
    data = json.loads(files["tokenizer.json"])
    vocab = dict(data["model"]["vocab"])
    vocab.update({e["content"]: e["id"] for e in data["added_tokens"]})
    return vocab


def _file_vocab(path: str) -> list[str]:
    vocab = _vocab({"tokenizer.json": Path(path, "tokenizer.json").read_bytes()})
    return sorted(vocab, key=vocab.__getitem__)


def _save(built: BuiltTokenizer, path: Path) -> Path:
    path.mkdir()
    for name, data in built.files:
        (path / name).write_bytes(data)
    return path


def test_base_source_without_changes_copies_the_files_byte_for_byte(trio: Trio) -> None:
    (Path(trio.a) / "tokenizer.model").write_bytes(b"sentencepiece")  # never part of a built tokenizer
    built = _build(trio, {"source": "base"}, base=trio.a)
    files = dict(built.files)
    assert list(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name, data in files.items():
        assert data == Path(trio.a, name).read_bytes(), name
    assert built.vocab_size == trio.rows[trio.a] == 26
    assert built.chat_template is None


def test_union_orders_other_models_tokens_by_their_ids_then_added_tokens(trio: Trio) -> None:
    built = _build(trio, {"source": "union"}, base=trio.a)
    vocab = _vocab(dict(built.files))
    by_id = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in by_id] == list(range(len(vocab))) and built.vocab_size == len(vocab) == 45
    base_tokens = _file_vocab(trio.a)
    added_anywhere = {"<s>", "</s>", "<|im_start|>", "foo", "<|im_end|>", "bar", "<|extra|>"}
    expected = list(base_tokens)
    for key in (trio.b, trio.c):
        kept = _file_vocab(key)[: trio.rows[key]]  # c's last token has no embedding row
        expected += [t for t in kept if t not in expected and t not in added_anywhere]
    expected += ["<|im_end|>", "bar"]
    assert by_id == expected
    assert "<|extra|>" not in vocab
    assert built.warnings == (f"{trio.c}: 1 tokens with ids >= its 24 embedding rows were dropped",)


def test_union_output_loads_in_transformers_and_encodes_added_tokens(trio: Trio, tmp_path: Path) -> None:
    section = {"source": "union", "tokens": {"<new>": {}, "the": {}}, "pad_to_multiple_of": 16}
    built = _build(trio, section, base=trio.a)
    files = dict(built.files)
    vocab = _vocab(files)
    assert vocab["<new>"] == 45 and built.vocab_size == 48  # "the" exists already: not added again
    new_entry = json.loads(files["tokenizer.json"])["added_tokens"][-1]
    assert new_entry == {"id": 45, "content": "<new>", "single_word": False, "lstrip": False, "rstrip": False,
                         "normalized": True, "special": False}
    config = json.loads(files["tokenizer_config.json"])
    assert config["added_tokens_decoder"]["45"]["content"] == "<new>"
    assert {int(i) for i in config["added_tokens_decoder"]} == {
        e["id"] for e in json.loads(files["tokenizer.json"])["added_tokens"]
    }
    loaded = transformers.AutoTokenizer.from_pretrained(str(_save(built, tmp_path / "out")))
    assert loaded.get_vocab() == vocab
    own = transformers.AutoTokenizer.from_pretrained(trio.a)
    ids = loaded("the cat<|im_end|>bar<new>")["input_ids"]
    assert ids == own("the cat")["input_ids"] + [vocab["<|im_end|>"], vocab["bar"], 45]


def test_model_source_and_base_defaulting_to_the_first_input(trio: Trio) -> None:
    built = _build(trio, {"source": trio.b}, base=None)
    assert dict(built.files)["tokenizer.json"] == Path(trio.b, "tokenizer.json").read_bytes()
    assert built.alignment.base is None
    assert _build(trio, {"source": "base"}, keys=[trio.c, trio.a]).vocab_size == 24  # c comes first: c's tokenizer


def test_stripped_base_drops_merges_that_make_dropped_tokens(tmp_path: Path) -> None:
    trio = make_trio(tmp_path / "m")
    rows = dict(trio.rows)
    rows[trio.a] = 20  # drops Ġcat, Ġmat, Ġon, Ġsat, <|im_start|>, foo
    trio = Trio(trio.a, trio.b, trio.c, rows)
    built = _build(trio, {"source": "base"}, base=trio.a)
    assert built.vocab_size == 20
    assert built.warnings[0] == f"{trio.a}: 6 tokens with ids >= its 20 embedding rows were dropped"
    data = json.loads(dict(built.files)["tokenizer.json"])
    assert ["Ġ", "cat"] not in data["model"]["merges"] and ["t", "he"] in data["model"]["merges"]
    assert [e["content"] for e in data["added_tokens"]] == ["<s>", "</s>"]
    assert json.loads(dict(built.files)["tokenizer_config.json"])["added_tokens_decoder"].keys() == {"0", "1"}
    loaded = tokenizers.Tokenizer.from_str(json.dumps(data))
    assert loaded.encode("the cat").tokens == ["the", "Ġ", "cat"]


def test_chat_templates_in_a_built_tokenizer(trio: Trio, tmp_path: Path) -> None:
    built = _build(trio, {"source": "union"}, base=trio.a, template="chatml")
    files = dict(built.files)
    assert files["chat_template.jinja"] == BUILTIN_TEMPLATES["chatml"].encode()
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == BUILTIN_TEMPLATES["chatml"]
    assert built.chat_template == BUILTIN_TEMPLATES["chatml"]
    loaded = transformers.AutoTokenizer.from_pretrained(str(_save(built, tmp_path / "out")))
    assert loaded.chat_template == BUILTIN_TEMPLATES["chatml"]
    nothing = _build(trio, {"source": "union"}, base=trio.a, template="auto")  # no input has a template
    assert nothing.chat_template is None and "chat_template.jinja" not in dict(nothing.files)


def test_same_inputs_give_the_same_bytes_in_any_process(trio: Trio) -> None:
    section = {"source": "union", "tokens": {"<new>": {"source": {"kind": "zero"}}}, "pad_to_multiple_of": 8}
    first = _build(trio, section, base=None, template="llama3")
    again = _build(trio, section, base=None, template="llama3")
    assert first == again
    script = (
        "import sys; from pathlib import Path\n"
        "from resumerge.merge.vocab import VocabInput, build_tokenizer, parse_tokenizer_spec\n"
        "keys, rows = sys.argv[1:4], [int(r) for r in sys.argv[4:7]]\n"
        "spec = parse_tokenizer_spec(None, {'source': 'union', 'tokens': {'<new>': {'source': {'kind': 'zero'}}},"
        " 'pad_to_multiple_of': 8}, 'llama3')\n"
        "built = build_tokenizer(spec, {k: VocabInput(k, Path(k), r) for k, r in zip(keys, rows)}, None)\n"
        "print(built.digest)\n"
    )
    args = [*trio.keys, *(str(trio.rows[k]) for k in trio.keys)]
    # Another process with its own string hashing: set and dict orders must not reach the output.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == first.digest


def test_digest_changes_with_every_setting(trio: Trio) -> None:
    digests = {
        _build(trio, {"source": "union"}, base=trio.a).digest,
        _build(trio, {"source": "union"}, base=None).digest,  # same files, base-row rule differs
        _build(trio, {"source": "union", "pad_to_multiple_of": 64}, base=trio.a).digest,
        _build(trio, {"source": "union", "tokens": {"the": {"source": {"kind": "zero"}}}}, base=trio.a).digest,
        _build(trio, {"source": "union"}, base=trio.a, template="chatml").digest,
    }
    assert len(digests) == 5


def test_a_token_nobody_has_is_reported(trio: Trio) -> None:
    built = _build(trio, {"source": "base", "tokens": {"brand": None}}, base=trio.a)
    assert built.vocab_size == 27
    assert missing_rows_report(built.alignment, trio.keys) == (MissingToken(26, "brand"),)
    assert missing_rows_report(built.alignment, [trio.a]) == (MissingToken(26, "brand"),)


@pytest.mark.parametrize(
    ("section", "message", "yaml_path"),
    [
        ({"source": "nowhere/model"}, "tokenizer source nowhere/model is not one of the merged models",
         "tokenizer.source"),
        ({"tokens": {"x": {"source": "nowhere/model"}}}, "is not one of the merged models",
         "tokenizer.tokens.x.source"),
        ({"tokens": {"x": {"source": {"kind": "model_token", "model": "A", "token_id": 26}}}},
         "Token ID 26 out of range for model", "tokenizer.tokens.x.source.token_id"),
        ({"tokens": {"x": {"source": {"kind": "model_token", "model": "A", "token": "zzz"}}}},
         "Token 'zzz' not found in model", "tokenizer.tokens.x.source.token"),
    ],
)
def test_config_errors(trio: Trio, section: dict[str, object], message: str, yaml_path: str) -> None:
    text = json.dumps(section).replace('"A"', json.dumps(trio.a))
    with pytest.raises(ConfigError, match=message) as caught:
        _build(trio, json.loads(text), base=trio.a)
    assert caught.value.yaml_path == yaml_path


def test_unusable_tokenizers(trio: Trio) -> None:
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    word_level.save(str(Path(trio.b, "tokenizer.json")))
    with pytest.raises(ModelInputError, match="is a WordLevel tokenizer: only BPE tokenizers can be merged"):
        _build(trio, {"source": "union"}, base=trio.a)
    Path(trio.b, "tokenizer.json").unlink()
    with pytest.raises(ModelInputError, match=r"has no tokenizer\.json: only BPE tokenizers can be merged"):
        _build(trio, {"source": "union"}, base=trio.a)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        Path(trio.b, name).unlink()
    with pytest.raises(ModelInputError, match=r"base model .* has no tokenizer"):
        _build(trio, {"source": "union"}, base=trio.b)
    data = json.loads(Path(trio.a, "tokenizer.json").read_text())
    del data["model"]["vocab"]["mat"]
    Path(trio.a, "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelInputError, match="does not number its 25 tokens"):
        _build(trio, {"source": "base"}, base=trio.a, keys=[trio.a, trio.c])
    with pytest.raises(ValueError, match="mapping from each input's key"):
        build_tokenizer(parse_tokenizer_spec("base", None, None), {"x": VocabInput("y", Path(trio.a), 3)}, None)
