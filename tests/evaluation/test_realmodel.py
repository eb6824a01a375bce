"""Parity on real trained weights: SmolLM2-135M-Instruct (tests/realmodel.py) evaluated by resumerge, one decoder
layer at a time, and by lm-eval's own ``hf`` model (transformers, float32): every request's log-likelihood to 1e-4,
every greedy flag and every metric the same, on a multiple-choice task with a few-shot example through the model's
chat template and on a perplexity task; and the GGUF file the folder was decoded from evaluates as the folder does.
The slowest of eval's tests: 135M parameters run five times on a few documents (4.5 minutes on the shared machine at
load 12, 11 with all six documents; now three and two)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from realmodel import smollm2_folder, smollm2_gguf

from resumerge import api
from tests.evaluation.evaltasks import hf_results, write_tasks
from tests.evaluation.test_parity import compare


@pytest.mark.slow
def test_smollm2_equals_lm_evals_hf_model_and_its_gguf_the_folder(tmp_path: Path) -> None:
    folder, tasks = smollm2_folder(), write_tasks(tmp_path)
    options = {"num_fewshot": 1, "apply_chat_template": True, "limit": 3}
    ours = api.evaluate(folder, ["tiny_mc"], api.Settings(state_dir=tmp_path / "state"),
                        harness=api.Harness(include_path=tasks, log_samples=True, **options))
    theirs = hf_results(folder, tasks, ["tiny_mc"], batch_size=12, **options)
    largest = compare(ours.results, theirs, ["tiny_mc"])
    rolled = api.Harness(include_path=tasks, limit=2, log_samples=True)
    rolling = api.evaluate(folder, ["tiny_ppl"], api.Settings(state_dir=tmp_path / "state"), harness=rolled)
    largest = max(largest, compare(rolling.results, hf_results(folder, tasks, ["tiny_ppl"], limit=2), ["tiny_ppl"]))
    print(f"SmolLM2-135M-Instruct: max |Δ loglik| {largest:.2e}; {ours.results['results']['tiny_mc']}; "
          f"{rolling.results['results']['tiny_ppl']}")
    gguf = api.evaluate(smollm2_gguf(), ["tiny_ppl"], api.Settings(state_dir=tmp_path / "state"), harness=rolled)
    assert gguf.results["results"] == rolling.results["results"]  # the folder is its decoded tensors: to the bit
