"""A check's tokenizer read without transformers (:mod:`resumerge.forward.text.plaintok`): the same token ids as
transformers' ``AutoTokenizer`` for the built-in texts in the chat template and for a texts file, on the tiny
models' tokenizer (with and without a template) and on SmolLM2-135M-Instruct's; every tokenizer it cannot read as
transformers does goes to transformers (the ids still transformers'); and a first check, or measure, of a model whose
tokenizer it reads never imports transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from realmodel import smollm2_folder

from resumerge.cli.modelgen import write_tokenizer
from resumerge.forward.text.plaintok import PlainTokenizer, plain_tokenizer
from resumerge.forward.text.texts import load_tokenizer, named, tokenizer_at

transformers = pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}{{ eos_token }}")
LINES = "hello world\n  two  spaces and\ttabs \nthe <s> token inside </s> text\nWordsWithCaps and über\n"


def _ids(tokenizer: object, texts: Path | None) -> list[list[int]]:
    return [t.ids for t in named(tokenizer, texts)]


def _same_as_transformers(folder: Path, texts: Path) -> PlainTokenizer:
    plain = plain_tokenizer(folder)
    assert isinstance(plain, PlainTokenizer)
    theirs = tokenizer_at(transformers, folder)
    assert _ids(plain, None) == _ids(theirs, None)
    assert _ids(plain, texts) == _ids(theirs, texts)
    assert plain.get_vocab() == theirs.get_vocab()  # how models of different vocabularies meet
    return plain


@pytest.mark.parametrize("template", [None, CHATML])
def test_the_tiny_models_tokenizer_gives_transformers_ids(tmp_path: Path, template: str | None) -> None:
    write_tokenizer(tmp_path, 96, chat_template=template)
    (tmp_path / "texts.txt").write_text(LINES)
    plain = _same_as_transformers(tmp_path, tmp_path / "texts.txt")
    assert (plain.chat_template is not None) == (template is not None)
    if template is not None:  # the template's text itself, special tokens named in it included
        chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
        assert plain.apply_chat_template(chat) == tokenizer_at(transformers, tmp_path).apply_chat_template(
            chat, tokenize=False)


def test_smollm2_s_tokenizer_and_chat_template_give_transformers_ids(tmp_path: Path) -> None:
    folder = smollm2_folder()
    (tmp_path / "texts.txt").write_text(LINES + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    plain = _same_as_transformers(folder, tmp_path / "texts.txt")
    assert plain.chat_template == (folder / "chat_template.jinja").read_text()
    assert load_tokenizer([tmp_path / "none", folder], plain=True).__class__ is PlainTokenizer


def _edited(folder: Path, **config: object) -> Path:
    doc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**doc, **config}))
    return folder


@pytest.mark.parametrize("case", ["add_bos_token", "unknown_bos", "class", "template_file", "generation",
                                  "special_map", "lstrip"])
def test_a_tokenizer_transformers_reads_otherwise_goes_to_transformers(tmp_path: Path, case: str) -> None:
    write_tokenizer(tmp_path, 96, chat_template=CHATML)
    if case == "add_bos_token":  # a class's post-processor rewritten by transformers (this one leaves it as it is)
        _edited(tmp_path, add_bos_token=True)
    elif case == "unknown_bos":  # transformers adds it as a new token
        _edited(tmp_path, bos_token="<start>")
    elif case == "class":  # a class of its own rebuilds the tokenizer in Python
        _edited(tmp_path, tokenizer_class="LlamaTokenizer")
    elif case == "template_file":
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    elif case == "generation":
        _edited(tmp_path, chat_template="{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    elif case == "special_map":
        (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "</s>"}))
    else:  # transformers adds the named token again with its own settings
        doc = json.loads((tmp_path / "tokenizer.json").read_text())
        doc["added_tokens"][1]["lstrip"] = True
        (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert plain_tokenizer(tmp_path) is None
    assert not isinstance(load_tokenizer([tmp_path], plain=True), PlainTokenizer)


def test_a_first_check_or_measure_of_a_plain_tokenizer_s_models_never_imports_transformers(tmp_path: Path) -> None:
    from resumerge.cli.modelgen import ModelSpec, make_model

    folders = []
    for seed, name in enumerate(("base", "merge")):
        folder = make_model(tmp_path / name, ModelSpec(layers=2, vocab=96), seed=seed)
        write_tokenizer(folder, 96, chat_template=CHATML)
        folders.append(str(folder))
    # A merge of more rows (a union's): how the vocabularies meet is read from each tokenizer's tokens (get_vocab),
    # the plain tokenizer's transformers' own (above), so its check (and eval's or evolve's kl of such a parent)
    # does not import transformers either.
    wider = make_model(tmp_path / "wider", ModelSpec(layers=2, vocab=112), seed=2)
    write_tokenizer(wider, 112, chat_template=CHATML)
    config = tmp_path / "rm.yml"  # measure reads its texts with the same tokenizer (one process: both asked)
    config.write_text(f"merge_method: regmean\nmodels:\n  - model: {folders[0]}\n  - model: {folders[1]}\n")
    code = ("import sys, json; from resumerge import api; s = api.Settings(state_dir=sys.argv[3]); "
            "r = api.check(sys.argv[1], s, base=sys.argv[2]); m = api.measure(sys.argv[4], sys.argv[5], s); "
            "w = api.check(sys.argv[6], s, base=sys.argv[2]); "
            "print(json.dumps(['transformers' in sys.modules, r.models[0].nll, m.tokens, w.shared_tokens]))")
    done = subprocess.run([sys.executable, "-c", code, folders[1], folders[0], str(tmp_path / "state"), str(config),
                           str(tmp_path / "grams"), str(wider)],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported, nll, tokens, shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported is False and nll > 0 and tokens > 0
    assert shared == 96

