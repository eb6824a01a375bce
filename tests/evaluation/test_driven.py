"""An evaluation's passes are jobs of the pass driver (:mod:`resumerge.forward.job.driver`): a pass is fitted before it
is placed (on Ray, a pass its budget cannot hold joins no cluster), and a pass's answer kept as one JSON file
(:class:`~resumerge.forward.job.driver.AnswerFile`) is read back as it was written, a file cut short by a crash
computed again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from resumerge import api
from resumerge.errors import UsageError
from resumerge.forward.job.driver import AnswerFile
from tests.evaluation.evaltasks import tiny_model, write_tasks


def test_on_ray_a_pass_its_budget_cannot_hold_is_refused_before_the_cluster_is_joined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver judges the fit, then places the pass: refused by --max-memory, the cluster is never asked.
    import resumerge.forward.placing.onray as onray
    from resumerge.merge.engine.executors import RayExecutor

    def joined(*args: object, **kwargs: object) -> None:
        pytest.fail("the Ray cluster was joined before the pass's budget was judged")

    monkeypatch.setattr(onray, "ray_places", joined)
    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    with pytest.raises(UsageError, match="the evaluation") as refused:
        api.evaluate(model, "tiny_mc", api.Settings(resources=api.Resources(max_memory="1MB"), state_dir=state,
                                                    executor=RayExecutor(address="127.0.0.1:1")),
                     harness=api.Harness(include_path=tasks))
    assert "--max-memory" in refused.value.one_line()
    assert not list(state.glob("evals/*/layer-*.safetensors"))


def test_an_answer_file_reads_back_what_it_kept_and_a_cut_file_is_computed_again(tmp_path: Path) -> None:
    kept = AnswerFile(tmp_path / "pass" / "answers.json", lambda doc: [(float(a), bool(b)) for a, b in doc])
    assert kept.read() is None  # nothing kept: the pass runs
    answers = [(-1.25, True), (-0.5, False)]
    kept.write(answers)  # its folder made
    assert kept.path.read_bytes() == json.dumps(answers).encode()
    assert kept.read() == answers
    kept.path.write_bytes(kept.path.read_bytes()[:7])  # cut short: not an answer, computed again
    assert kept.read() is None
    by_batch = AnswerFile(tmp_path / "heads-000000.json", lambda doc: {int(k): v for k, v in doc},
                          lambda found: sorted(found.items()))
    by_batch.write({3: 1.0, 1: 2.0})
    assert by_batch.path.read_text() == "[[1, 2.0], [3, 1.0]]" and by_batch.read() == {1: 2.0, 3: 1.0}
