"""The model's ``generation_config.json`` as transformers' ``generate`` (lm-eval's ``hf`` model) applies it
(:mod:`resumerge.analyses.evaluation.genconfig`): on a tiny generated Llama whose file sets ``repetition_penalty``,
``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens`` and ``begin_suppress_tokens``, greedy answers
equal lm-eval's ``hf`` model's, the whole model held and one layer at a time; the file changed, the journal is not
reused; a setting resumerge does not honour is refused in one line naming it and the file (exit 2), before any
weight is read. In this process: seconds (lm-eval's import aside)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from support import cli_here

from resumerge import api
from resumerge.analyses.evaluation.genconfig import Processors
from resumerge.forward.engine.stream import ModelStream
from tests.evaluation.evaltasks import hf_results, tiny_model, write_tasks

TASK = "tiny_long"
# the tokens every step of the tiny model's greedy answers chooses among (its vocabulary is 64 letters and words)
SETTINGS = {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2, "min_new_tokens": 3, "suppress_tokens": [5, 9],
            "begin_suppress_tokens": [11, 12, 13], "do_sample": False, "temperature": 1.0, "max_length": 20}


def _tasks(root: Path) -> Path:
    """tiny_gen's data, generating 10 tokens with no stop sequence that occurs (every processor has steps to act)."""
    tasks = write_tasks(root)
    text = (tasks / "tiny_gen.yaml").read_text().replace("task: tiny_gen", f"task: {TASK}")
    (tasks / f"{TASK}.yaml").write_text(text.replace('{until: ["\\n"], max_gen_toks: 8}',
                                                     '{until: ["never"], max_gen_toks: 10}'))
    return tasks


def _model(root: Path, settings: dict[str, Any]) -> Path:
    model = tiny_model(root)
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    (model / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": eos}))
    return model


def _answers(results: dict[str, Any]) -> list[Any]:
    return [s["resps"] for s in results["samples"][TASK]]


def _evaluate(model: Path, tasks: Path, state: Path) -> list[Any]:
    return _answers(api.evaluate(model, [TASK], api.Settings(state_dir=state),
                                 harness=api.Harness(include_path=tasks, log_samples=True)).results)


def _three_ways(model: Path, tasks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[list[Any], list[Any], list[Any]]:
    """The answers of lm-eval's hf model, of resumerge with the model held whole and layer-streamed."""
    from resumerge.analyses.evaluation import run

    theirs = _answers(hf_results(model, tasks, [TASK]))
    whole = _evaluate(model, tasks, tmp_path / "whole")
    with monkeypatch.context() as patch:
        patch.setattr(run, "_fits", lambda stream, settings: False)
        streamed = _evaluate(model, tasks, tmp_path / "streamed")
    return theirs, whole, streamed


def test_greedy_answers_follow_the_models_generation_config_as_lm_evals_hf_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    model, tasks = _model(tmp_path / "model", SETTINGS), _tasks(tmp_path)
    theirs, whole, streamed = _three_ways(model, tasks, tmp_path, monkeypatch)
    assert whole == streamed == theirs
    # the file changed (gone): the same state dir generates anew, and the processors did change the answers
    (model / "generation_config.json").unlink()
    plain = _evaluate(model, tasks, tmp_path / "whole")
    assert plain != whole
    assert all(len(a[0][0].split()) == 10 for a in plain)


def test_each_processor_as_transformers_applies_it(tmp_path: Path) -> None:
    """Each honoured setting alone, on random logits after a context and tokens made: the scores transformers'
    own processor gives, bit for bit (the oracle, test-only)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation import LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    context, made = [3, 7, 3, 9, 7], [3, 4, 7]
    logits = torch.randn(32, generator=torch.Generator().manual_seed(0))
    for settings in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 3},
                     {"min_new_tokens": 4}, {"min_length": 9}, {"suppress_tokens": [1, 2]},
                     {"begin_suppress_tokens": [1, 2]}):
        for done in (made, []):
            (tmp_path / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [0, 31]}))
            from resumerge.analyses.evaluation.genconfig import processors_of

            ours = processors_of(tmp_path)(logits, context, done)
            given = GenerationConfig(**settings, eos_token_id=[0, 31])
            given._eos_token_tensor = torch.tensor([0, 31])
            mixin: Any = GenerationMixin.__new__(GenerationMixin)
            mixin.config = type("C", (), {"is_encoder_decoder": False})()
            processors: LogitsProcessorList = mixin._get_logits_processor(
                given, input_ids_seq_length=len(context), encoder_input_ids=torch.tensor([context]),
                device="cpu", model_kwargs={})
            theirs = processors(torch.tensor([context + done]), logits[None].clone())[0]
            assert torch.equal(ours, theirs), (settings, done)
    assert processors_of(tmp_path / "none") == Processors()


@pytest.mark.parametrize(("setting", "value"), [("forced_eos_token_id", 2), ("bad_words_ids", [[3]]),
                                                ("num_beams", 4), ("max_new_tokens", 5)])
def test_a_setting_not_honoured_is_refused_before_any_weight_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: Any) -> None:
    model, tasks = _model(tmp_path / "model", {setting: value, "num_beams": 1} if setting != "num_beams"
                          else {setting: value}), _tasks(tmp_path)

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ModelStream, "load", never)
    done = cli_here("eval", model, "--tasks", TASK, "--include-path", tasks, "--state-dir", tmp_path / "state")
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and f"{setting}=" in line and str(model / "generation_config.json") in line
    assert not (tmp_path / "state" / "evals").exists()


def test_a_tasks_generation_kwargs_give_the_processors_over_the_file_as_generate_takes_them(tmp_path: Path) -> None:
    """A task's ``generation_kwargs`` naming ``repetition_penalty`` and ``no_repeat_ngram_size`` (refused before:
    "resumerge does not honour it"): lm-eval's ``hf`` model passes them to ``generate``, which takes them over the
    file's; the answers equal its, and differ from the file's own settings alone."""
    model, tasks = _model(tmp_path / "model", SETTINGS), _tasks(tmp_path)
    own = _evaluate(model, tasks, tmp_path / "own")
    text = (tasks / f"{TASK}.yaml").read_text()
    (tasks / f"{TASK}.yaml").write_text(text.replace(
        '{until: ["never"], max_gen_toks: 10}',
        '{until: ["never"], max_gen_toks: 10, repetition_penalty: 1.15, no_repeat_ngram_size: 3}'))
    theirs = _answers(hf_results(model, tasks, [TASK]))
    assert _evaluate(model, tasks, tmp_path / "given") == theirs
    assert theirs != own


def test_without_a_generation_config_the_config_jsons_end_tokens_end_a_continuation_as_generate_ends_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``generation_config.json``: transformers makes the generation config from ``config.json``, whose
    ``eos_token_id`` (here a list, as Llama 3's, naming a plain word besides the tokenizer's end token) ends
    lm-eval's ``hf`` model's continuations at that word; resumerge's answers (held whole and one layer at a time)
    end there too (they ran on to ``max_gen_toks`` before)."""
    from transformers import AutoTokenizer

    from resumerge.analyses.evaluation.genconfig import end_tokens

    model, tasks = tiny_model(tmp_path / "model"), _tasks(tmp_path)
    assert not (model / "generation_config.json").exists()
    plain = _evaluate(model, tasks, tmp_path / "plain")
    tokenizer = AutoTokenizer.from_pretrained(model)
    made = tokenizer(plain[0][0][0], add_special_tokens=False)["input_ids"]
    word = made[2]  # the third token of the first answer: a plain word, not the tokenizer's end token
    assert word != tokenizer.eos_token_id
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], word]}))
    assert end_tokens(model) == (config["eos_token_id"], word)
    theirs, whole, streamed = _three_ways(model, tasks, tmp_path, monkeypatch)
    assert whole == streamed == theirs
    assert whole != plain and len(whole[0][0][0]) < len(plain[0][0][0])
    # a file naming no end token: transformers stops on none of the config's (the file replaces it)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert end_tokens(model) == ()
    (model / "generation_config.json").unlink()
    # a multimodal config (Gemma 3's): the end tokens of its text_config, the top level naming none
    (model / "config.json").write_text(json.dumps({"model_type": "x", "text_config": {"eos_token_id": [1, 106]}}))
    assert end_tokens(model) == (1, 106)
