"""An evaluation's tokenizer read without transformers (:mod:`resumerge.analyses.evaluation.evaltok`): the same ids,
texts and special tokens as transformers' ``AutoTokenizer`` (what lm-eval's ``hf`` model loads) on the suite's
tokenizers, the tiny models' and SmolLM2-135M-Instruct's; a tokenizer whose decoding transformers rewrites goes to
transformers; and an evaluation without a chat template never imports transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from realmodel import smollm2_folder

from resumerge.analyses.evaluation.evaltok import EvalTokenizer, eval_tokenizer
from resumerge.cli.modelgen import write_tokenizer
from resumerge.forward.text.texts import tokenizer_at
from tests.evaluation.evaltasks import tiny_model, write_tasks

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

TEXTS = ["hello world", "  two  spaces and\ttabs ", "the <s> token inside </s> text", "WordsWithCaps and über",
         "", " The answer is", "<|im_start|>user\nWhat is 2+2?<|im_end|>", "Question: 12 times 7?\nAnswer: 84"]


def _same_as_transformers(folder: Path) -> None:
    ours = eval_tokenizer(folder)
    assert isinstance(ours, EvalTokenizer)
    theirs = tokenizer_at(transformers, folder)
    for name in ("bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "name_or_path", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.eos_token_id is not None
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            specials = [i for i in (ours.bos_token_id, ours.eos_token_id) if i is not None]
            for made in (ids, [*ids, *specials], ids[1:]):
                for skip in (True, False):
                    assert ours.decode(made, skip_special_tokens=skip) == theirs.decode(
                        made, skip_special_tokens=skip), (made, skip)
    for token in (ours.bos_token_id, ours.eos_token_id):
        assert token is not None and ours.decode(token) == theirs.decode(token)


@pytest.mark.parametrize("limit", [None, 128])
def test_the_tiny_models_tokenizer_is_transformers(tmp_path: Path, limit: int | None) -> None:
    write_tokenizer(tmp_path, 96)
    if limit is not None:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": limit}))
    _same_as_transformers(tmp_path)


def test_smollm2_s_tokenizer_is_transformers() -> None:
    _same_as_transformers(smollm2_folder())


def test_a_tokenizer_whose_decoding_transformers_rewrites_is_transformers(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 96)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert eval_tokenizer(tmp_path) is None


_EVALUATE = """
import sys
from resumerge import api
api.evaluate(sys.argv[1], ["tiny_mc"], api.Settings(state_dir=sys.argv[3]),
             harness=api.Harness(include_path=sys.argv[2], limit=2))
print("transformers" in sys.modules)
"""


def test_an_evaluation_without_a_chat_template_never_imports_transformers(tmp_path: Path) -> None:
    model, tasks = tiny_model(tmp_path / "model"), write_tasks(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).parents[2]),
                                                                     os.environ.get("PYTHONPATH"))))}
    said = subprocess.run([sys.executable, "-c", _EVALUATE, str(model), str(tasks), str(tmp_path / "state")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert said.returncode == 0, said.stderr
    assert said.stdout.split()[-1] == "False"
