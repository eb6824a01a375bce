"""What the user sees of a MoE merge: mergekit-moe's warnings in the log, ``status`` and the model card; the
missing optional dependency of the prompt gate modes as one exit-2 line; mergekit-moe's flags accepted."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.config.locations import state_root
from resumerge.errors import InterruptedMerge, ModelInputError, UsageError, exit_code_for
from resumerge.forward.engine.reader import CastReader
from resumerge.machine.memory.sizes import parse_size
from resumerge.runs.moe import passcost
from tests.moe.models import llamas, write
from tests.moe.passthread import passes_on_a_thread
from tests.support import cli, cli_here

DEGENERATE = "layers 0 and 1 have degenerate routing parameters - your prompts may be too similar."
POWER = "Your model has 3 experts, which is not a power of two. The model will not be usable in llama.cpp."


def _config(tmp_path: Path, mode: str = "cheap_embed") -> Path:
    m = llamas(tmp_path)
    return write(tmp_path / "moe.yml", {
        "base_model": str(m[0]), "gate_mode": mode,
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"]},
                    {"source_model": str(m[2]), "positive_prompts": ["ab ab"]},
                    {"source_model": str(m[0]), "positive_prompts": ["ab cd"]}]})


def test_warnings_reach_status_and_the_model_card(tmp_path: Path) -> None:
    # hidden gates: the pass runs beside the merge, so its warning comes once the routers are known (the same
    # function warns about cheap_embed's routers, known when the plan is made). The pass's process is not what
    # this tests: the pass runs on a thread here, an interpreter start saved.
    out, config = tmp_path / "out", _config(tmp_path, "hidden")
    with passes_on_a_thread():
        outcome = api.run(config, out, settings=api.Settings(state_dir=tmp_path / "state"))
        notes = api.status(out, settings=api.Settings(state_dir=tmp_path / "state")).plan_notes
        assert POWER in notes and any(n.startswith(DEGENERATE) for n in notes)
        assert outcome.plan.notes == notes
        card = (out / "README.md").read_text()
        assert f"- {POWER}" in card and DEGENERATE in card and "Mixture of Experts" in card
        # the card says what the run was: a mixture of experts, not a merge
        assert "# Mixture of experts" in card and "Merged model" not in card and "This is a merge" not in card
        # a later run finds the pass finished: the warning is the plan's own from the start
        again = api.run(config, tmp_path / "again", settings=api.Settings(state_dir=tmp_path / "state"))
    assert again.plan.notes == notes
    assert (tmp_path / "again" / "README.md").read_text() == card.replace(str(out), str(tmp_path / "again"))


def test_cheap_embed_routers_too_alike_are_warned_when_the_plan_is_made(tmp_path: Path) -> None:
    # cheap_embed's routers are the prompts' mean embeddings, known before the merge: "ab" and "ab ab" give one
    # router twice (singular), distinct prompts do not; the warning is mergekit-moe's, in the notes and the card.
    m = llamas(tmp_path)
    for name, prompts, warned in (("alike", (["ab"], ["ab ab"], ["ab cd"]), True),
                                  ("apart", (["ab cd ef"], ["zz yy"], ["mn op qr st"]), False)):
        config = write(tmp_path / f"{name}.yml", {
            "base_model": str(m[0]), "gate_mode": "cheap_embed",
            "experts": [{"source_model": str(m[i]), "positive_prompts": p} for i, p in zip((1, 2, 0), prompts)]})
        outcome = api.run(config, tmp_path / name, settings=api.Settings(state_dir=tmp_path / "state"))
        notes = api.status(tmp_path / name, settings=api.Settings(state_dir=tmp_path / "state")).plan_notes
        assert outcome.plan.notes == notes and POWER in notes
        assert any(n.startswith(DEGENERATE) for n in notes) is warned, notes
        assert (DEGENERATE in (tmp_path / name / "README.md").read_text()) is warned


def test_prompt_modes_without_transformers_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "no-transformers" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    done = cli("run", _config(tmp_path), tmp_path / "out", "--load-in-4bit", env=env)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("note: --load-in-4bit is not needed by resumerge")
    assert len(lines) == 2 and lines[1].startswith("error: gate_mode: gate_mode cheap_embed needs transformers")
    assert "pip install" in lines[1]
    assert not (tmp_path / "out").exists()


def test_plan_merge_plans_without_running_anything(hidden: tuple[Path, list[Path]], tmp_path: Path,
                                                   probed_once: None) -> None:
    config, m = hidden
    plan = api.plan_merge(config, settings=api.Settings(merging=api.Merging(random_seed=5)))
    assert plan.method == "moe" and len(plan.tensors) == 21 and plan.out_config["num_local_experts"] == 2
    # the routers are named by their pass's content key, in a last shard of their own (merged beside the pass)
    key = dict(plan.tensors["model.layers.1.mlp.gate.weight"].params)["routers"]
    assert plan.shards[-1].tensors == ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")
    # Stable across runs.
    assert api.plan_merge(config,
                          settings=api.Settings(merging=api.Merging(random_seed=5))).fingerprint == plan.fingerprint
    for changed in ({"positive_prompts": ["ab", "x"]}, {"negative_prompts": ["cd"]}):
        other = write(tmp_path / "other.yml", {
            "base_model": str(m[0]), "gate_mode": "hidden",
            "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"], **changed},
                        {"source_model": str(m[2]), "positive_prompts": ["cd"]}]})
        replanned = api.plan_merge(other, settings=api.Settings(merging=api.Merging(random_seed=5)))
        assert dict(replanned.tensors["model.layers.1.mlp.gate.weight"].params)["routers"] != key
        assert replanned.fingerprint != plan.fingerprint
    # plan's estimate counts the pass (its process started once to see what it holds), without running it
    estimate = api.estimate(config, tmp_path / "out", probe_size=0)
    assert estimate.time.prepass_seconds > 0 and estimate.memory.prepass_bytes > 100_000_000  # torch alone
    memory = estimate.memory
    assert memory.prepass_beside and estimate.time.prepass_beside  # the default budget holds both processes
    assert memory.peak_bytes == memory.baseline_bytes + memory.working_set_bytes + memory.prepass_bytes
    # the router units read nothing (the pass is estimated apart): not timed, and not reported as failing
    assert "moe_router_values" not in {g.method for g in estimate.time.compute}
    assert all(g.seconds is not None for g in estimate.time.compute)
    assert not (state_root() / "moe-routers").exists()  # the forward pass did not run



@pytest.fixture(scope="module")
def hidden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A hidden-gates config over three tiny Llamas (and the models), for this module's plans and runs."""
    root = tmp_path_factory.mktemp("hidden")
    m = llamas(root)
    return write(root / "hidden.yml", {
        "base_model": str(m[0]), "gate_mode": "hidden",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"]},
                    {"source_model": str(m[2]), "positive_prompts": ["cd"]}]}), m


@pytest.fixture(scope="module")
def probes() -> dict[str, dict[str, Any]]:
    """The answers of the pass's probe processes this module's plans started, by job."""
    return {}


@pytest.fixture
def probed_once(probes: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan``'s probe of the pass (a process started to see what it holds and how long it takes to start: an
    import of torch and transformers, ~5 CPU s) run once in this module for a job: a later plan of the same job
    (the same base, prompts and mode) is given that process's answer, as its own probe would give it (up to the
    few hundred KB two starts differ by)."""
    real = passcost.run_child

    def once(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
        key = json.dumps(job, sort_keys=True)
        if key not in probes:
            probes[key] = real(job, workdir)
        return probes[key]

    monkeypatch.setattr(passcost, "run_child", once)


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory, installation_cache: Path,
            hidden: tuple[Path, list[Path]]) -> tuple[Path, Path, Path, UsageError]:
    """The module's hidden-gates merge run at ``--max-memory 200MB``: its config, OUT, state dir and the run's
    refusal, made once for the two tests below (each ran it: a forward-pass process started and refused, ~6 CPU
    s)."""
    root = tmp_path_factory.mktemp("refused")
    config = hidden[0]
    out, state = root / "out", root / "state"
    with pytest.MonkeyPatch.context() as patch:  # as conftest's ``hermetic`` sets them for a test
        patch.setenv("XDG_CACHE_HOME", str(installation_cache))
        patch.setenv("HF_HOME", str(root / "hf"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("RESUMERGE_STATE_DIR", str(root / "home-state"))
        patch.setenv("XDG_STATE_HOME", str(root / "xdg-state"))
        with pytest.raises(UsageError) as stopped:
            api.run(config, out, settings=api.Settings(state_dir=state, resources=api.Resources(max_memory="200MB")))
    return config, out, state, stopped.value


def test_the_passes_refusal_is_the_runs_one_line(refused: tuple[Path, Path, Path, UsageError]) -> None:
    # the forward pass runs in a process of its own (tests/moe/test_resume.py shows transformers never enters the
    # run's): its refusal, its memory share too small for a layer, comes back as the run's exit-2 error
    _, out, _, error = refused
    assert exit_code_for(error) == 2 and "\n" not in error.one_line()
    assert error.message.startswith("the prompt forward pass needs")
    assert "--max-memory" in error.one_line() and not out.exists()


def test_a_transformers_that_cannot_import_is_named_before_anything_is_written(tmp_path: Path) -> None:
    # transformers 4.57 beside huggingface_hub 2.x (what installing a huggingface_hub>=1.0 package did to a
    # transformers-4 environment): installed, but its import fails. The run names the version clash and exits 2
    # before OUT exists, instead of failing from the forward pass after the first shards were committed.
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'is_offline_mode' from 'huggingface_hub'\")\n")
    (site / "transformers-4.57.6.dist-info").mkdir()
    (site / "transformers-4.57.6.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformers\nVersion: 4.57.6\n"
        "Requires-Dist: huggingface-hub<1.0,>=0.34.0\nRequires-Dist: fugashi>=1.0; extra == \"ja\"\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = cli("run", _config(tmp_path, "hidden"), tmp_path / "out", "--state-dir", tmp_path / "state", env=env)
    assert done.returncode == 2, done.stderr
    from importlib.metadata import version

    assert (f"transformers 4.57.6 needs huggingface-hub<1.0,>=0.34.0, and huggingface-hub "
            f"{version('huggingface-hub')} is installed") in done.stderr
    assert not (tmp_path / "out").exists()


def _broken_transformers(tmp_path: Path) -> dict[str, str]:
    """An environment whose transformers fails to import with its requirements met (not refused up front)."""
    blocker = tmp_path / "broken-transformers" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('partially initialized module')\n")
    return {"PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}


def _unreadable_tokenizer(config: Path) -> None:
    """The base's tokenizer.json made one the tokenizers library cannot read (it raises a bare Exception)."""
    base = Path(yaml.safe_load(config.read_text())["base_model"])
    doc = json.loads((base / "tokenizer.json").read_text())
    doc["model"]["type"] = "NoSuchModel"
    (base / "tokenizer.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("fault", "line"), [
    ("transformers", "error: gate_mode: gate_mode hidden needs transformers, and the installed one fails to import: "
                     "ImportError: partially initialized module — pip install -U transformers"),
    ("tokenizer", "error: base_model: cannot load the base model's tokenizer from "),
])
def test_run_refuses_before_its_first_weight_what_plan_refuses(tmp_path: Path, fault: str, line: str) -> None:
    # plan's probe of the forward pass and the run's pass make their checks through one function (pass_checks), and
    # the run's merge starts once its pass has made them. A transformers that fails to import with its requirements
    # met: plan refused it (exit 2) while run failed from the pass beside the merge after the other shards were
    # committed (exit 3, "finish it with resume", which failed the same way). A base tokenizer.json the tokenizers
    # library cannot read: "the prompt forward pass failed (exit 1): Exception: ..." from both, run's after its
    # shards. (transformers 5's tokenizer on transformers 4: tests/hub/test_transformers4_stack.py.)
    config, out, state = _config(tmp_path, "hidden"), tmp_path / "out", tmp_path / "state"
    env = _broken_transformers(tmp_path) if fault == "transformers" else None
    if fault == "tokenizer":
        _unreadable_tokenizer(config)
    # the broken transformers is a process's environment; the unreadable tokenizer is met by the CLI's main here
    planned = cli("plan", config, out, "--state-dir", state, "--probe-size", "0", env=env) if env else cli_here(
        "plan", config, out, "--state-dir", state, "--probe-size", "0")
    if env:
        ran = cli("run", config, out, "--state-dir", state, "--out-shard-size", "30k", env=env)
    else:  # the pass's checks on a thread (its own process: tests/moe/test_passproc.py reads its errors back)
        with passes_on_a_thread():
            ran = cli_here("run", config, out, "--state-dir", state, "--out-shard-size", "30k")
    assert (planned.returncode, ran.returncode) == (2, 2), (planned.stderr, ran.stderr)
    assert line in planned.stderr and ran.stderr.startswith(line) and ran.stderr.count("\n") == 1, ran.stderr
    assert not out.exists()


def test_an_input_error_after_the_first_commit_is_not_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Exit 2 promises that nothing was written. The pass runs beside the merge once it has made its checks, and its
    # routers are the last shard: an input error the pass meets after its checks (here, reading the base's first
    # weight) comes once the other shards are committed, and is exit 3 with the resume command.
    def unreadable(*args: object) -> None:
        raise ModelInputError("the base's weights cannot be read", path="base")

    monkeypatch.setattr(CastReader, "read", unreadable)  # the forward engine's reader: the pass's first weight
    out = tmp_path / "out"
    with passes_on_a_thread(), pytest.raises(InterruptedMerge) as stopped:
        api.run(_config(tmp_path, "hidden"), out, settings=api.Settings(state_dir=tmp_path / "state",
                                                                        output=api.Output(out_shard_size="30k")))
    assert exit_code_for(stopped.value) == 3
    assert stopped.value.message == "the merge stopped: base: the base's weights cannot be read"
    assert stopped.value.resume_command.startswith(f"resumerge resume {out}")
    assert list(out.glob("model-*.safetensors"))


def _tree_peak_anon(argv: list[str]) -> tuple[int, int]:
    """Run ``argv``; its exit code and the peak of its process tree's summed anonymous RSS (sampled every 10 ms).

    The tree is walked through ``/proc/PID/task/TID/children``: psutil's ``children(recursive=True)`` reads every
    process of the machine each time (about 12 ms of CPU, so the sampler took half a core from the run it
    measured); where the kernel lacks those files, psutil still walks it."""
    import subprocess
    import sys
    import time

    import psutil

    def anon(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as status:
                return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
        except (OSError, StopIteration):
            return 0

    def children(pid: int) -> list[int]:
        found: list[int] = []
        with contextlib.suppress(OSError):  # gone meanwhile
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as listed:
                    found += [int(child) for child in listed.read().split()]
        return found

    def tree(pid: int) -> list[int]:
        pids, todo = [], [pid]
        while todo:
            pids.append(todo.pop())
            todo += children(pids[-1])
        return pids

    # A fresh interpreter, not support.cli_start: a child forked from the fork server would count its torch pages.
    proc = subprocess.Popen([sys.executable, "-m", "resumerge", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    root, peak = psutil.Process(proc.pid), 0
    listed = os.path.exists(f"/proc/{proc.pid}/task/{proc.pid}/children")
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            pids = tree(proc.pid) if listed else [p.pid for p in [root, *root.children(recursive=True)]]
            peak = max(peak, sum(anon(pid) for pid in pids))
        time.sleep(0.01)
    return proc.returncode, peak


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_plan_refuses_the_pass_where_the_run_would_and_the_pass_stays_inside_the_budget(
        refused: tuple[Path, Path, Path, UsageError], tmp_path: Path, probed_once: None) -> None:
    """plan said "fits" (its peak over the budget) where the run's guard refused the pass; at the budget the
    refusal named, the processes together peaked over it."""
    config, _, _, error = refused
    out, state = tmp_path / "out", tmp_path / "state"  # the refused run's OUT stays unwritten for the test above
    estimate = api.estimate(config, out, api.Settings(state_dir=state, resources=api.Resources(max_memory="200MB")),
                            probe_size=0)
    assert not estimate.fits
    (said,) = [r for r in estimate.reasons if "the prompt forward pass needs" in r]
    # One rule: the same sentence, up to what each process holds (a few MB apart).
    budget = parse_size(said.rsplit("--max-memory ", 1)[1].split()[0])
    run_budget = parse_size(error.one_line().rsplit("--max-memory ", 1)[1].split()[0])
    assert abs(budget - run_budget) <= 0.05 * budget, (said, error.one_line())
    assert api.estimate(config, out, settings=api.Settings(state_dir=state,
                                                           resources=api.Resources(max_memory=budget)),
                        probe_size=0).fits
    code, peak = _tree_peak_anon(["run", str(config), str(out), "--state-dir", str(state),
                                  "--max-memory", str(budget), "--quiet"])
    assert code == 0
    assert peak <= budget, f"the run's processes peaked at {peak / 1e6:.0f} MB over the {budget / 1e6:.0f} MB budget"
