"""``resumerge evolve --wandb --trackio``: the search logged to W&B (offline: its run files, decoded) and trackio (its
local SQLite store), a row per candidate with its genotype, figures and objective, a summary per generation, the best
config as an artifact; killed between generations (the first generation durable, not logged) and inside the second
(the first logged), then resumed by the command ``resumerge status STORAGE`` says continues it (the
logging flags in it): every candidate row exactly once, in the same run. Real processes killed (SIGKILL),
the last start unkilled: 3-6 minutes on the shared machine, most of it W&B's service starting."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

# Installed, not imported: their imports (about 4 CPU s at collection, paid by each worker) are the commands'; this
# process only reads the files they write (W&B's through tests.wandbfiles, which imports its protobufs then).
if not all(importlib.util.find_spec(name) for name in ("wandb", "trackio")):
    pytest.skip("wandb and trackio are not installed", allow_module_level=True)

from tests.evolve.test_search import OPTIONS, make_search
from tests.support import cli
from tests.wandbfiles import wandb_rows

KILLS = ("after_evolve_generation:1", "after_evolve_candidate:1")
def _trackio_rows(root: Path, project: str) -> tuple[list[dict[str, object]], set[str]]:
    (database,) = root.rglob(f"{project}.db")
    with sqlite3.connect(database) as db:
        found = db.execute("select run_name, metrics from metrics").fetchall()
    return [json.loads(metrics) for _, metrics in found], {name for name, _ in found}


@pytest.mark.slow
def test_a_killed_and_resumed_search_logs_every_candidate_once(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_search(tmp_path)
    store = tmp_path / "store"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true",
           "TRACKIO_DIR": str(tmp_path / "trackio")}
    (tmp_path / "wandb").mkdir()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = ("evolve", config, store, "--max-fevals", str(OPTIONS["max_fevals"]), "--popsize", str(OPTIONS["popsize"]),
            "--random-seed", str(OPTIONS["random_seed"]), "--wandb", "--wandb-project", "search", "--trackio",
            "--trackio-project", "search")
    for kill in KILLS:
        done = cli(*args, env={**env, "RESUMERGE_KILL_AT": kill}, timeout=600)
        assert done.returncode == -9, (kill, done.stderr[-2000:])
    # resumed by the command `status` says continues it: it logs on (its flags), to the same run, no row twice
    status = cli("status", store, "--json", env=env)
    assert status.returncode == 0, status.stderr[-2000:]
    resume = shlex.split(json.loads(status.stdout)["resume_command"])
    assert resume[:2] == ["resumerge", "evolve"] and " ".join(resume).endswith(
        "--wandb --wandb-project search --trackio --trackio-project search")
    # a process of its own too: trackio reads TRACKIO_DIR once, when it is first imported (never in this process);
    # forked from the worker's server, which imports neither trackio nor wandb (their variables are read in the command)
    done = cli(*resume[1:], "--json", env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    json.loads(done.stdout)  # trackio's own lines kept off stdout
    expected = Counter({(1, 1): 1, (1, 2): 1, (2, 1): 1, (2, 2): 1})
    table = [json.loads(line) for line in (store / "evaluations.jsonl").read_text().splitlines()]

    rows, ids, artifacts = wandb_rows(tmp_path / "wandb")
    candidates = [r for r in rows if "candidate/objective" in r]
    assert Counter((int(r["candidate/generation"]), int(r["candidate/number"])) for r in candidates) == expected
    for row in candidates:
        told = next(t for t in table if (t["generation"], t["candidate"]) == (int(row["candidate/generation"]),
                                                                              int(row["candidate/number"])))
        assert float(row["candidate/objective"]) == pytest.approx(told["objective"], rel=1e-12)
        assert [float(row[f"candidate/x{i}"]) for i in range(len(told["genotype"]))] == \
            pytest.approx(told["genotype"], rel=1e-12)
        assert float(row["candidate/kl:a:a.txt"]) == pytest.approx(told["tasks"]["kl:a:a.txt"], rel=1e-12)
    assert sorted(int(r["population/generation"]) for r in rows if "population/generation" in r) == [1, 2]
    assert len(ids) == 1, "the resumed search logs to the same run"
    assert "best_config" in artifacts

    found, runs = _trackio_rows(tmp_path / "trackio", "search")
    assert Counter((int(r["candidate/generation"]), int(r["candidate/number"]))  # type: ignore[call-overload]
                   for r in found if "candidate/objective" in r) == expected
    assert sorted(r["population/generation"] for r in found if "population/generation" in r) == [1, 2]
    assert len(runs) == 1


def test_the_command_that_continues_a_search_keeps_where_it_is_logged(tmp_path: Path) -> None:
    from resumerge.api.evolution import SearchAsked, evolve_command
    from resumerge.api.options import Resources
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.search import SearchOptions
    from resumerge.runs.evolve.tracking import Tracking

    logged = [Tracking("wandb", "my runs", "team"), Tracking("trackio", "mine")]
    command = evolve_command(SearchAsked(tmp_path / "c.yml", tmp_path / "s", SearchOptions(max_fevals=4),
                                         Resources(), StateDir.resolve(), tracking=logged))
    assert shlex.split(command)[-8:] == ["--wandb", "--wandb-project", "my runs", "--wandb-entity", "team",
                                         "--trackio", "--trackio-project", "mine"]
