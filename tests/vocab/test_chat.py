"""Chat templates: validation, the built-ins' rendered formats, ``auto``, and writing templates into files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.vocab import (
    BUILTIN_TEMPLATES,
    apply_chat_template,
    apply_chat_template_files,
    check_chat_template,
    read_chat_template,
    resolve_chat_template,
)
from tests.vocab.gen import make_tokenizer_dir

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
# The standard prompt format of each family for CONVERSATION, with the generation prompt.
EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] Be brief.\n\nHi there [/INST] Hello!</s>[INST] Bye [/INST]",
    "alpaca": "Be brief.\n\n### Instruction:\nHi there\n\n### Response:\nHello!\n\n### Instruction:\nBye\n\n"
    "### Response:\n",
    "exaone": "[|system|]Be brief.[|endofturn|]\n[|user|]Hi there\n[|assistant|]Hello![|endofturn|]\n"
    "[|user|]Bye\n[|assistant|]",
}
JINJA = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> transformers.PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_dir(path, ["hello", "world"])
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtins_render_their_standard_format(tokenizer: transformers.PreTrainedTokenizerBase, name: str) -> None:
    template = resolve_chat_template(name, [])
    assert template == BUILTIN_TEMPLATES[name]
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert rendered == EXPECTED[name]


def test_builtins_without_generation_prompt_and_without_system(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    turns = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Yo"}]

    def render(name: str, prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            turns, chat_template=BUILTIN_TEMPLATES[name], tokenize=False, add_generation_prompt=prompt
        )
        assert isinstance(text, str)
        return text

    assert render("chatml", False) == "<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    assert render("llama3", False).endswith("<|end_header_id|>\n\nYo<|eot_id|>")
    assert render("mistral", True) == "<s>[INST]  Hi  [/INST] Yo</s>"
    assert render("alpaca", True) == "### Instruction:\nHi\n\n### Response:\nYo"
    assert render("exaone", False) == "[|system|][|endofturn|]\n[|user|] Hi \n[|assistant|]Yo[|endofturn|]\n"
    with pytest.raises(Exception, match="must alternate"):
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            chat_template=BUILTIN_TEMPLATES["mistral"],
            tokenize=False,
        )


@pytest.mark.parametrize("value", ["auto", "chatml", "llama3", JINJA])
def test_valid_values(value: str) -> None:
    check_chat_template(value)


@pytest.mark.parametrize("value", ["chatml2", "ChatML", "{{ messages }}", "no braces in this long text", "chatml\n"])
def test_invalid_values_use_mergekits_message(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_chat_template(value)
    assert caught.value.message == f"Invalid chat template: {value}"
    assert caught.value.yaml_path == "chat_template"


def test_literal_template_is_used_as_written() -> None:
    assert resolve_chat_template(JINJA, []) == JINJA


def test_auto_picks_the_most_common_template_first_seen_on_ties(tmp_path: Path) -> None:
    x, y = JINJA, JINJA + "!"
    dirs = []
    for name, template in [("p", y), ("q", x), ("r", None), ("s", x + "\n")]:
        make_tokenizer_dir(tmp_path / name, ["hi"], chat_template=template)
        dirs.append(tmp_path / name)
    (tmp_path / "bare").mkdir()  # no tokenizer at all: skipped, as mergekit skips unloadable tokenizers
    (tmp_path / "bare" / "chat_template.jinja").write_text(y)
    assert resolve_chat_template("auto", [*dirs, tmp_path / "bare"]) == x  # x twice (once with a newline), y once
    assert resolve_chat_template("auto", dirs[:2]) == y  # one each: the first seen wins
    assert resolve_chat_template("auto", [dirs[2]]) is None


def test_read_chat_template_prefers_the_jinja_file_and_named_defaults(tmp_path: Path) -> None:
    make_tokenizer_dir(tmp_path, ["hi"], chat_template="from the config {{ x }}")
    assert read_chat_template(tmp_path) == "from the config {{ x }}"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"


def test_apply_chat_template_keeps_key_order_and_is_byte_exact() -> None:
    config = b'{"z": 1, "chat_template": "old", "a": "\\u00e9"}'
    assert apply_chat_template(config, "new {{ x }}") == (
        '{\n  "z": 1,\n  "chat_template": "new {{ x }}",\n  "a": "é"\n}\n'.encode()
    )
    assert apply_chat_template(b'{"a": 1}', "T") == b'{\n  "a": 1,\n  "chat_template": "T"\n}\n'
    with pytest.raises(ModelInputError, match="must hold a JSON object"):
        apply_chat_template(b"[1]", "T", path="donor/tokenizer_config.json")


def test_apply_chat_template_files_replaces_a_donors_jinja_file() -> None:
    files = [
        ("tokenizer.json", b"{}"),
        ("chat_template.jinja", b"stale"),
        ("tokenizer_config.json", b'{"chat_template": "stale"}'),
        ("chat_template.json", b'{"chat_template": "stale"}'),
    ]
    out = dict(apply_chat_template_files(files, "T {{ x }}"))
    assert list(out) == sorted(out)
    assert out["chat_template.jinja"] == b"T {{ x }}"
    assert json.loads(out["tokenizer_config.json"]) == {"chat_template": "T {{ x }}"}
    assert json.loads(out["chat_template.json"]) == {"chat_template": "T {{ x }}"}
    assert out["tokenizer.json"] == b"{}"
    created = dict(apply_chat_template_files([("tokenizer.json", b"{}")], "T"))
    assert set(created) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_a_copied_tokenizer_with_a_template_loads_with_it(tmp_path: Path) -> None:
    donor = tmp_path / "donor"
    make_tokenizer_dir(donor, ["hello", "world"], chat_template="stale {{ messages }}")
    (donor / "chat_template.jinja").write_text("stale jinja {{ messages }}")
    files = [(p.name, p.read_bytes()) for p in sorted(donor.iterdir())]
    out = tmp_path / "out"
    out.mkdir()
    for name, data in apply_chat_template_files(files, BUILTIN_TEMPLATES["chatml"]):
        (out / name).write_bytes(data)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.chat_template == BUILTIN_TEMPLATES["chatml"]
