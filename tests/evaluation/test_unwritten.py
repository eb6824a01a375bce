"""A merge config as TARGET: evaluated as the merge it describes, each tensor merged in memory by run's own method
code as its layer runs, never written; every request's log-likelihood equals that of the written merge to 1e-6 and
every metric is the same (linear and slerp, bfloat16 output: the same bytes as run writes). In this process: 5-10 s
each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from support import write_config

from resumerge import api
from tests.evaluation.evaltasks import tiny_model, write_tasks


def _losses(results: dict[str, Any], task: str) -> list[float]:
    found = []
    for sample in results["samples"][task]:
        for (answer,) in sample["resps"]:
            found.append(answer[0] if isinstance(answer, tuple) else answer)
    return found


@pytest.mark.parametrize("method", ["linear", "slerp"])
def test_an_unwritten_merge_scores_as_the_written_one(tmp_path: Path, method: str) -> None:
    a, b = tiny_model(tmp_path / "a", seed=0), tiny_model(tmp_path / "b", seed=1)
    tasks = write_tasks(tmp_path)
    if method == "linear":
        doc: dict[str, object] = {"merge_method": "linear", "dtype": "bfloat16", "models": [
            {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]}
    else:
        doc = {"merge_method": "slerp", "base_model": str(a), "dtype": "bfloat16", "parameters": {"t": 0.4},
               "models": [{"model": str(a)}, {"model": str(b)}]}
    config = write_config(tmp_path / f"{method}.yml", doc)
    state = tmp_path / "state"
    names = ["tiny_mc", "tiny_ppl"]
    unwritten = api.evaluate(config, names, api.Settings(state_dir=state),
                             harness=api.Harness(include_path=tasks, log_samples=True))
    assert not list((state / "unwritten").rglob("*.safetensors")), "no weight is written"
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=state), progress=False)
    written = api.evaluate(out, names, api.Settings(state_dir=state),
                           harness=api.Harness(include_path=tasks, log_samples=True))
    for task in names:
        assert unwritten.results["results"][task] == written.results["results"][task]
        assert _losses(unwritten.results, task) == pytest.approx(_losses(written.results, task), abs=1e-6, rel=0)
