"""CPU of a tiny ``evolve`` search scored on an lm-eval task where lm-eval indexes its own ~14,700 task YAMLs
(``TaskManager(include_defaults=True)``, as for any task of lm-eval's own): how many managers the search builds, the
process CPU seconds of the search, and the digest of its ``evaluations.jsonl`` (equal across versions: the same
figures). Tiny generated models (three layers, width 32), a local multiple-choice task, one generation of 4.

    PYTHONPATH=TREE python bench/bench_evolve_tasks.py SCRATCH [ROWS]   # TREE: the resumerge tree to measure"""

from __future__ import annotations

import hashlib
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any


def main(scratch: Path, keep: Path | None) -> None:
    import lm_eval.tasks
    import yaml

    from resumerge import api
    from tests.evaluation.evaltasks import tiny_model, write_tasks

    built: list[bool] = []

    class Whole(lm_eval.tasks.TaskManager):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # lm-eval's own tasks indexed every time
            built.append(True)
            super().__init__(*args, **{**kwargs, "include_defaults": True})

    lm_eval.tasks.TaskManager = Whole
    for seed, name in enumerate(("base", "a", "b")):
        tiny_model(scratch / name, seed=seed, context=64)
    write_tasks(scratch)
    doc = {"genome": {"models": [str(scratch / "a"), str(scratch / "b")], "merge_method": "task_arithmetic",
                      "base_model": str(scratch / "base")},
           "tasks": [{"name": "tiny_mc", "metric": "acc,none"}], "limit": 4, "apply_chat_template": False}
    config = scratch / "evolve.yml"
    config.write_text(yaml.safe_dump(doc))
    before = resource.getrusage(resource.RUSAGE_SELF)
    api.evolve(config, scratch / "store", search=api.Search(max_fevals=4, popsize=4),
               task_search_path=scratch / "tasks")
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    # the rows with this run's scratch folder named SCRATCH (the candidates' configs name the models by path)
    rows = (scratch / "store" / "evaluations.jsonl").read_bytes().replace(str(scratch).encode(), b"SCRATCH")
    if keep is not None:  # the rows kept for a comparison across versions
        keep.write_bytes(rows)
    print(f"managers built {len(built)}  search CPU {cpu:.1f} s  evaluations.jsonl sha256 "
          f"{hashlib.sha256(rows).hexdigest()[:16]}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as folder:
        main(Path(folder), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
