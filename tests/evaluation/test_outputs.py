"""What ``resumerge eval`` prints and writes, as lm-eval's CLI does: the results table; ``--json`` lm-eval's results
object (``results`` → task → ``metric,filter``, ``configs``, ``versions``, ``n-shot``); ``--output-path`` its results
file and, with ``--log-samples``, each task's samples file (``resps``: the per-request log-likelihoods). In this
process (the CLI's main): a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from support import cli_here

from tests.evaluation.evaltasks import tiny_model, write_tasks


def test_json_the_table_and_lm_evals_files(tmp_path: Path) -> None:
    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    out = tmp_path / "results"
    args = ["eval", model, "--tasks", "tiny_mc,tiny_ppl", "--include-path", tasks, "--state-dir", state, "-q",
            "--limit", "3", "--output-path", out, "--log-samples"]
    done = cli_here(*args, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert {"results", "configs", "versions", "n-shot"} <= set(doc) and "samples" not in doc
    assert set(doc["results"]["tiny_mc"]) >= {"acc,none", "acc_norm,none", "acc_stderr,none"}
    assert set(doc["results"]["tiny_ppl"]) >= {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"}
    assert doc["n-shot"] == {"tiny_mc": 0, "tiny_ppl": 0} and doc["config"]["limit"] == 3
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    folder = model.name  # named after the model's own folder, never its path's spelling (issue 97, item 7)
    assert [w.split("/")[0] for w in written] == [folder] * 3, written
    results = [p for p in out.rglob("results_*.json")]
    assert len(results) == 1 and json.loads(results[0].read_text())["results"] == doc["results"]
    kept = list(json.loads(results[0].read_text()))  # the machine described where simple_evaluate describes it
    assert kept[kept.index("date") + 1:kept.index("date") + 5] == ["pretty_env_info", "transformers_version",
                                                                  "lm_eval_version", "upper_git_hash"]
    samples = [json.loads(line) for p in out.rglob("samples_tiny_mc_*.jsonl") for line in p.read_text().splitlines()]
    assert len(samples) == 3 and all(len(s["resps"]) == 4 and len(s["filtered_resps"]) == 4 for s in samples)
    table = cli_here(*args[:-3])  # answered from the journal: the same figures, as lm-eval's table
    assert table.returncode == 0, table.stderr
    assert "|tiny_mc |" in table.stdout.replace("|tiny_mc|", "|tiny_mc |") and "word_perplexity" in table.stdout
