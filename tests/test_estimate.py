"""``resumerge plan`` estimates: exact output size, peak RSS close to a real run's, downloads from the hub
metadata, and a verdict that refuses a merge whose output cannot fit (free space injected through the API).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from conftest import ModelFactory
from hub.conftest import REPO, SPEC, big_model, hf_env, hub, models, state  # noqa: F401  (fixtures for the hub test)
from hub.fakehub import FakeHub
from support import cli, cli_here, linear_config, peak_rss_run, write_config

from resumerge import api
from resumerge.analyses.estimate import compute as compute_estimate
from resumerge.analyses.estimate.compute import measure_compute, start_compute
from resumerge.analyses.estimate.computegroup import ComputeGroup
from resumerge.analyses.estimate.costs import FITS, WILL_NOT_FIT, Estimate, TimeEstimate
from resumerge.analyses.estimate.disks import disk_reason
from resumerge.analyses.estimate.memory import pending_units, working_set
from resumerge.analyses.estimate.method_timing import Timing
from resumerge.analyses.estimate.torchside import TorchHere
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model
from resumerge.inputs import kernels
from resumerge.inputs.safetensors_format import numel
from resumerge.inputs.source import InputSources, LocalFiles
from resumerge.inputs.tensorio import TensorReader
from resumerge.machine.diskprobe import PROBE_PREFIX
from resumerge.merge.engine.unitgroup import GROUP_UNITS, group_bytes
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.workunits import WHOLE, unit_bytes
from resumerge.merge.store.manifest import MANIFEST_NAME
from tests.manylayers import many_layer_merge

T = TypeVar("T")

# Big enough that the working set is a large part of the peak (embeddings of 16 MB per input), small enough to
# generate and merge in a few seconds.
MID = {"layers": 2, "hidden": 512, "intermediate": 1024, "vocab": 8000, "heads": 8, "kv_heads": 8,
       "shard_bytes": 100_000_000, "tokenizer": False}


def _plan_json(*args: str | Path) -> dict[str, object]:
    # In this process (the CLI's main): the peak it prints counts a fresh run's baseline, measured once per
    # installation (resumerge.merge.engine.footprint.run_baseline), not the process that plans; no interpreter started.
    done = cli_here("plan", *args, "--json", "--probe-size", "1MiB")
    assert done.returncode == 0, done.stderr
    doc: dict[str, object] = json.loads(done.stdout)
    return doc


def test_output_size_is_exact(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    est = api.estimate(cfg, out, probe_size=0, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    assert est.fits and est.verdict == FITS
    api.run(cfg, out, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    shards = {n: s for n, s in sizes.items() if n.endswith(".safetensors")}
    assert len(shards) > 1 and sum(shards.values()) == est.output.shard_bytes
    assert max(shards.values()) == est.output.largest_shard_bytes
    assert sizes[MANIFEST_NAME] == est.output.manifest_bytes
    assert sum(sizes.values()) - sum(shards.values()) - sizes[MANIFEST_NAME] == est.output.aux_bytes
    assert sum(sizes.values()) == est.output.total_bytes
    finished = api.estimate(cfg, out, probe_size=0, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    assert finished.time.compute == () and finished.time.compute_seconds == 0  # nothing pending: nothing timed


def test_a_resumable_out_needs_only_what_is_left(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    killed = cli("run", cfg, out, "--out-shard-size", "30k", "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert killed.returncode == -signal.SIGKILL
    committed = json.loads((out / MANIFEST_NAME).read_text())["committed"]
    done_bytes = sum(int(f["bytes"]) for f in committed.values())
    fresh = api.estimate(cfg, tmp_path / "elsewhere", probe_size=0,
                         settings=api.Settings(output=api.Output(out_shard_size="30k")))
    est = api.estimate(cfg, out, probe_size=0, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    assert len(committed) == 2 and est.output.committed_bytes == done_bytes
    assert est.output.needed_bytes == fresh.output.needed_bytes - done_bytes
    assert est.time.rehash_bytes == done_bytes  # resume re-hashes what is committed
    assert est.time.read_bytes < fresh.time.read_bytes
    # Another plan: refused by run.
    other = api.estimate(cfg, out, probe_size=0, settings=api.Settings(output=api.Output(out_shard_size="40k")))
    assert other.output.committed_bytes == 0 and any("different merge" in n for n in other.notes)


def test_output_that_cannot_fit_is_refused(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    roomy = api.estimate(cfg, out, probe_size=0, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    (disk,) = roomy.disks  # OUT and the state dir share tmp's filesystem
    assert set(disk.roles) == {"output", "state"} and disk.needed_bytes > roomy.output.total_bytes

    exact = api.estimate(cfg, out, probe_size=0, disk_free=lambda path: disk.needed_bytes,
                         settings=api.Settings(output=api.Output(out_shard_size="30k")))
    assert exact.fits
    short = api.estimate(cfg, out, probe_size=0, disk_free=lambda path: disk.needed_bytes - 1,
                         settings=api.Settings(output=api.Output(out_shard_size="30k")))
    assert not short.fits and short.verdict == WILL_NOT_FIT
    (reason,) = short.reasons
    assert reason.startswith("disk: output + state need") and "choose an OUT on a disk with more room" in reason
    doc = short.to_json()
    assert doc["fits"] is False and doc["verdict"] == "will not fit" and doc["reasons"] == [reason]

    alone = disk_reason(replace(disk, roles=("output",)), short.output)
    assert alone.startswith("disk: output needs "), alone  # one role: "needs", as the table's line says

    staged = api.estimate(cfg, out, probe_size=0, disk_free=lambda path: disk.needed_bytes,
                          settings=api.Settings(output=api.Output(out_shard_size="30k"),
                                                resources=api.Resources(staging=True)))
    assert staged.output.staging_bytes == staged.output.largest_shard_bytes > 0
    assert not staged.fits and "--out-shard-size" in staged.reasons[0]  # one shard more than the disk holds
    assert not out.exists()


def test_plan_exit_codes_and_json_schema(tmp_path: Path, make: ModelFactory,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["plan", str(cfg), str(out), "--json", "--probe-size", "1MiB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # the probe file is gone, nothing was written
    assert not any(p.name.startswith(PROBE_PREFIX) for p in tmp_path.rglob("*"))
    assert doc["schema"] == 1 and doc["verdict"] == "fits" and doc["fits"] is True and doc["reasons"] == []
    for key in ("method", "tensors", "layers", "shards", "output_bytes", "config_donor", "tokenizer_donor",
                "fingerprint", "notes", "output", "download", "memory", "disks", "time"):
        assert key in doc, key
    assert set(doc["output"]) == {"dir", "shard_bytes", "aux_bytes", "manifest_bytes", "total_bytes",
                                  "largest_shard_bytes", "committed_bytes", "needed_bytes", "staging_dir",
                                  "staging_bytes"}
    assert doc["download"] == {"bytes": 0, "verify_bytes": 0, "cached_bytes": 0, "models": {}}
    assert set(doc["memory"]) == {"budget", "budget_source", "machine_bytes", "baseline_bytes",
                                  "counted_baseline_bytes", "working_set_bytes", "peak_bytes",
                                  "largest_unit_bytes", "smallest_budget", "prepass_bytes", "prepass_beside",
                                  "first_pass_bytes", "first_pass_baseline_bytes",
                                  "first_pass_merge_baseline_bytes"}
    assert doc["memory"]["budget_source"] == "default" and doc["memory"]["peak_bytes"] > 100_000_000
    assert doc["memory"]["prepass_bytes"] == 0 and doc["time"]["prepass_seconds"] == 0  # a merge has no pass
    assert doc["first_pass"] is None and doc["time"]["first_pass_seconds"] == 0  # nor one before it
    assert [d["roles"] for d in doc["disks"]] == [["output", "state"]]
    time = doc["time"]
    assert time["read_bytes_per_s"] > 0 and time["write_bytes_per_s"] > 0 and time["seconds"] > 0
    (group,) = time["compute"]
    assert group["method"] == "linear" and group["seconds_per_element"] > 0 and group["sample_bytes"] > 0
    assert time["compute_seconds"] >= 0 and time["disk_seconds"] >= 0 and time["tail_seconds"] >= 0
    assert not any("not included" in n for n in time["notes"]) and time["notes"][0].startswith("compute: linear")
    assert time["read_bytes"] == sum(p.stat().st_size for d in (a, b) for p in d.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for d in (a, b) for p in d.glob("*.safetensors"))

    assert main(["plan", str(cfg), str(out), "--max-memory", "1MB", "--probe-size", "0"]) == 2
    captured = capsys.readouterr()
    assert "will not fit" in captured.out
    assert captured.err.startswith("will not fit: memory: tensor ") and "--max-memory" in captured.err
    assert main(["plan", str(cfg), "--max-memory", "1MB", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["memory"]["smallest_budget"] > 1_000_000


def _peak_within_band(name: str, doc: dict[str, object], cfg: Path, out: Path, *options: str) -> None:
    """``run`` of ``cfg`` into ``out`` (with ``options``), its own peak RSS measured, against the peak ``doc`` (plan
    --json's) estimated. Under is the danger (an OOM after "fits"), so the floor is tight; over is the price of
    counting a fresh process's whole baseline (torch's mapped libraries included) as --max-memory now does:
    1.16-1.26x here."""
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", str(cfg), str(out), "--quiet", *options])
    assert code == 0, err
    memory = doc["memory"]
    assert isinstance(memory, dict)
    estimated = memory["peak_bytes"]
    print(f"{name}: estimated {estimated / 1e6:.0f} MB ({memory['baseline_bytes'] / 1e6:.0f} + "
          f"{memory['working_set_bytes'] / 1e6:.0f}), measured {peak / 1e6:.0f} MB")
    assert 0.9 <= estimated / peak <= 1.35, f"{name}: estimated {estimated}, measured {peak}"


@pytest.mark.slow
def test_peak_rss_estimate_is_never_under_a_real_run_and_within_35_percent_over(tmp_path: Path,
                                                                                 make: ModelFactory) -> None:
    a, b = make("a", seed=1, **MID), make("b", seed=2, **MID)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    free = _plan_json(cfg, tmp_path / "free")
    # A budget that binds: 100 MB above what this machine's interpreter and torch hold (what the budget counts).
    counted = free["memory"]["counted_baseline_bytes"]  # type: ignore[index]
    bound_options = ["--max-memory", str(int(counted) + 100_000_000)]
    bound = _plan_json(cfg, tmp_path / "bound", *bound_options)
    # type: ignore[index]
    assert bound["memory"]["working_set_bytes"] < 100_000_000 < free["memory"]["working_set_bytes"]
    for name, doc, options in (("free", free, []), ("bound", bound, bound_options)):
        _peak_within_band(name, doc, cfg, tmp_path / name, *options)
        assert sum(p.stat().st_size for p in (tmp_path / name).iterdir()) == doc["output"]["total_bytes"]  # type: ignore[index]


# A regmean merge's peak is its widest solve (down_proj's n x n float64 buffers, n = intermediate) beside the
# embeddings' mean: a wide MLP makes the solve the larger part.
WIDE = {"layers": 2, "hidden": 512, "intermediate": 2048, "vocab": 4000, "heads": 8, "kv_heads": 8,
        "tokenizer": True}


@pytest.mark.slow
def test_peak_rss_estimate_of_a_regmean_merge_is_within_the_same_band(tmp_path: Path, make: ModelFactory) -> None:
    """``plan`` over-estimated regmean's peak 1.9-2.2x (its solve declared 8 n² of float64 and 8 bytes per weight
    element per input): now the footprint is the measured one and the peak is held to the linear merge's band.
    (regmean_plus is the same method declaration, on Grams measured otherwise: the same estimate.)"""
    method = "regmean"
    pytest.importorskip("transformers")
    a, b = make("a", seed=1, **WIDE), make("b", seed=2, **WIDE)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": method, "dtype": "float32",
                                            "models": [{"model": str(a)}, {"model": str(b)}],
                                            "parameters": {"grams": str(tmp_path / "grams")}})
    measured = cli_here("measure", cfg, tmp_path / "grams", "-q")
    assert measured.returncode == 0, measured.stderr
    _peak_within_band(method, _plan_json(cfg, tmp_path / "out"), cfg, tmp_path / "out")


def test_a_regmean_solve_is_timed_on_grams_that_take_the_cholesky_path(tmp_path: Path, make: ModelFactory) -> None:
    """``plan`` timed regmean's solve on random matrices for its Grams: no Gram is one (not symmetric, not positive
    definite), so the Cholesky factorisation failed and the pseudo-inverse was timed, a path real Grams do not take
    (the estimate 0.3-1x the run's compute). The synthetic Grams are positive definite, well conditioned."""
    pytest.importorskip("transformers")
    from resumerge.analyses.estimate.synthetic import synthetic_inputs
    from resumerge.merge.methods.regmean import GRAM, regmean_solve

    a, b = make("a", seed=1, hidden=32, intermediate=48, vocab=64), make("b", seed=2, hidden=32, intermediate=48,
                                                                         vocab=64)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "regmean", "models": [{"model": str(a)},
                                            {"model": str(b)}], "parameters": {"grams": str(tmp_path / "grams")}})
    assert cli_here("measure", cfg, tmp_path / "grams", "-q").returncode == 0
    plan = api.plan_merge(cfg)
    # down_proj's Grams are of another shape than its weight; q_proj's (32 x 32) of the same, no fine-tune of it
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        tp = plan.tensors[name]
        marked = [dict(p).get(GRAM, False) for p in tp.model_params]
        assert marked == [False, False, True, True]
        for grams, pinv in ((True, False), (False, True)):
            made = synthetic_inputs(tp, torch.device("cpu"), grams=grams)
            weights, gram = [t for t, m in zip(made, marked) if not m], [t for t, m in zip(made, marked) if m]
            assert regmean_solve(weights, gram, 0.5)[1] is pinv, (name, grams)
        for g in synthetic_inputs(tp, torch.device("cpu"), grams=True)[2:]:
            assert torch.equal(g, g.T) and float(torch.linalg.eigvalsh(g.double()).min()) >= 0.5


def test_hub_downloads_are_estimated_from_metadata_and_drop_once_verified(
    tmp_path: Path, hub: FakeHub, state: Path, models: tuple[object, ...]  # noqa: F811
) -> None:
    local = make_model(tmp_path / "local", SPEC, seed=7)
    cfg = write_config(tmp_path / "c.yml", {
        "merge_method": "task_arithmetic", "base_model": REPO,
        "models": [{"model": REPO}, {"model": str(local), "parameters": {"weight": 0.7}}],
    })
    weights = {name: size for name, size in _served_sizes(models[0]).items() if name.endswith(".safetensors")
               and "/" not in name}
    est = api.estimate(cfg, tmp_path / "out", settings=api.Settings(state_dir=state), probe_size=0)
    assert est.download_bytes == sum(weights.values()) > 0
    assert sum(hub.file_bytes().get(n, 0) for n in weights) < sum(weights.values())  # headers only so far
    assert est.downloads[REPO].cached_bytes == 0 and est.downloads[REPO].repo == REPO
    assert "hub cache" in est.disks[0].roles
    assert any("download time is not included" in n for n in est.time.notes)
    assert main(["run", str(cfg), str(tmp_path / "out"), "--state-dir", str(state), "--quiet"]) == 0
    after = api.estimate(cfg, tmp_path / "out2", settings=api.Settings(state_dir=state), probe_size=0)
    assert after.download_bytes == 0 and after.downloads[REPO].verify_bytes == 0
    assert after.downloads[REPO].cached_bytes == sum(weights.values())


def _served_sizes(model: object) -> dict[str, int]:
    files = getattr(model, "files")  # noqa: B009  (hub.conftest.Model, typed as object to keep imports light)
    return {name: len(data) for name, data in files.items()}


def test_status_rendering_stays_off_torch_sqlite_utils_and_the_estimator() -> None:
    probe = "import sys; import resumerge.cli.render, resumerge.merge.store.statusview; " \
            "print(sorted(m for m in ('torch', 'sqlite_utils', " \
            "'resumerge.analyses.estimate.estimate') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env=dict(os.environ))
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


class _Counting(InputSources):
    """Local inputs that count the bytes read through them."""

    def __init__(self, model_dirs: Mapping[str, str]) -> None:
        reader = TensorReader()
        super().__init__({k: LocalFiles(d, reader) for k, d in model_dirs.items()}, shared=reader)
        self.bytes = 0

    def read(self, model: str, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.bytes += end - start
        return super().read(model, file, start, end, dtype, shape)


def _ties_plan(make: ModelFactory, tmp_path: Path) -> Plan:
    base, a, b = (make(n, seed=i, hidden=64, intermediate=128) for i, n in enumerate("xab"))
    cfg = write_config(tmp_path / "ties.yml", {
        "merge_method": "ties", "base_model": str(base), "dtype": "float32",
        "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in (a, b)],
    })
    return api.plan_merge(cfg, settings=api.Settings(output=api.Output(out_shard_size="60k")))


def test_ties_compute_is_measured_on_the_inputs_and_scales_with_pending_work(tmp_path: Path,
                                                                           make: ModelFactory) -> None:
    plan = _ties_plan(make, tmp_path)
    assert len(plan.shards) >= 4
    elements = {s.name: sum(numel(plan.tensors[n].shape) for n in s.tensors) for s in plan.shards}
    counting = _Counting(plan.model_dirs)
    (full,) = measure_compute(plan, plan.shards, sources=counting)
    assert full.method == "ties" and full.elements == sum(elements.values()) and not full.synthetic
    assert full.seconds is not None and full.seconds > 0 and full.sample_bytes == counting.bytes > 0
    half = plan.shards[len(plan.shards) // 2:]  # the first half committed, as in a resumed run
    (rest,) = measure_compute(plan, half)
    assert rest.elements == sum(elements[s.name] for s in half) < full.elements
    assert rest.seconds == pytest.approx(rest.seconds_per_element * rest.elements)

    # A budget of 48 kB reads at most 48 kB, not the 3 x 32 kB inputs of each sampled MLP matrix.
    small = _Counting(plan.model_dirs)
    (capped,) = measure_compute(plan, plan.shards, sources=small, max_bytes=48_000)
    assert 0 < small.bytes == capped.sample_bytes <= 48_000 and capped.seconds_per_element is not None


def test_inputs_not_on_disk_are_timed_on_synthetic_tensors(tmp_path: Path, make: ModelFactory) -> None:
    plan = _ties_plan(make, tmp_path)
    elsewhere = replace(plan, model_dirs={k: str(tmp_path / "not-downloaded") for k in plan.model_dirs})
    (group,) = measure_compute(elsewhere, plan.shards)
    assert group.synthetic and group.sample_bytes == 0 and group.seconds_per_element is not None
    assert "synthetic" in group.line()
    (off,) = measure_compute(plan, plan.shards, max_seconds=0)
    assert off.seconds is None and off.seconds_per_element is None and "not measured" in off.line()
    if not torch.cuda.is_available():
        on_gpu = replace(plan, options=replace(plan.options, device="cuda"))
        (gpu,) = measure_compute(on_gpu, plan.shards)
        assert gpu.seconds is None and "no GPU" in gpu.note


def test_a_sample_is_timed_by_its_threads_cpu_only_where_its_kernels_stay_on_that_thread(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serial (the workers fill torch's threads), a sample is timed by its thread's CPU time only where
    ``serial_kernels`` took effect: without an OpenMP runtime its kernels stay on torch's threads, of which this
    thread's CPU would count only its share (about half on two threads), so the wall clock times it."""
    plan = _ties_plan(make, tmp_path)
    clocks: list[Callable[[], float]] = []
    real = compute_estimate.measure_rate

    def recording(*args: Any, timing: Timing, **kwargs: Any) -> Any:
        clocks.append(timing.clock)
        return real(*args, timing=timing, **kwargs)

    monkeypatch.setattr(compute_estimate, "measure_rate", recording)

    def clocks_of(serial: bool) -> set[Callable[[], float]]:
        clocks.clear()
        (group,) = measure_compute(plan, plan.shards, serial=serial, max_seconds=0.05)
        assert group.seconds_per_element is not None
        return set(clocks)

    assert clocks_of(False) == {time.perf_counter}
    if kernels._openmp() is not None:  # torch's OpenMP runtime is reachable here
        assert clocks_of(True) == {time.thread_time}
    monkeypatch.setattr(kernels, "_openmp", lambda: None)
    assert clocks_of(True) == {time.perf_counter}


class _Sending(TorchHere):
    """A side in this process that records how the sample reached it: sent ahead, or called for its result."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        self.sent += ["call"] if fn.__name__ == "_measure_samples" else []
        return fn(*args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        self.sent.append("submit")
        return super().submit(fn, *args)


def test_the_sample_overlaps_planning_only_where_its_threads_cpu_times_it(tmp_path: Path, make: ModelFactory,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample is sent ahead (measured while ``plan`` estimates the rest) only where it is timed on one thread
    by its CPU time, which work beside it does not change; timed by the wall clock (torch's threads, or kernels
    that ``serial_kernels`` could not hold to one thread) it is measured last, with nothing beside it."""
    plan = _ties_plan(make, tmp_path)

    def sent(serial: bool) -> tuple[list[str], list[str]]:
        side = _Sending()
        result = start_compute(plan, plan.shards, max_seconds=0, serial=serial, side=side)
        started = list(side.sent)
        result()
        return started, side.sent

    if kernels._openmp() is not None:  # torch's OpenMP runtime is reachable here
        assert sent(True) == (["submit"], ["submit"])
    assert sent(False) == ([], ["call"])
    monkeypatch.setattr(kernels, "_openmp", lambda: None)
    assert sent(True) == ([], ["call"])


def test_compute_and_disk_work_overlap_in_the_total() -> None:
    group = ComputeGroup("ties", "float32", "cpu", 10, 1_000_000, 1000, 4000, 1e-5, 2)  # 10 s of compute
    disk = TimeEstimate(100_000_000, 100_000_000, 0, 0, 100e6, 100e6, 0, 1.0, tail_bytes=50_000_000)  # 2 s
    assert disk.seconds == pytest.approx(3.0) and disk.compute_seconds == 0
    both = replace(disk, compute=(group,))
    # compute hides the disk work except the last shard's flush (0.5 s), which waits for the last tensor
    assert both.compute_seconds == pytest.approx(10) and both.seconds == pytest.approx(1 + 10 + 0.5)
    # where the engine's threads fill the cores (2 here), page-cache copies, hashing and writes take CPU from the
    # methods: the two add up (the last shard's flush is part of the disk work)
    assert replace(both, shared_cores=True).seconds == pytest.approx(1 + 2 + 10)
    fixed = replace(group, seconds_per_call=0.1)  # plus a fixed 0.1 s for each of the 10 tensors
    assert fixed.seconds == pytest.approx(11) and "100.0 ms per tensor" in fixed.line()
    # a pass in a process of its own (MoE's prompt forward pass) starts with the run: beside the merge the longer
    # of the two counts, before it the merge waits for the pass and the start-up both
    passing = replace(both, prepass_seconds=20.0)
    assert replace(passing, prepass_beside=True).seconds == pytest.approx(20 + 0.4)  # + the routers' shard
    assert replace(passing, prepass_beside=True, prepass_seconds=5.0).seconds == pytest.approx(1 + 10 + 0.5)
    assert passing.seconds == pytest.approx(20 + 10 + 0.5)
    # on cores shared with other processes, both processes' work over the cores left to them bounds the run:
    # (start-up 1 + merge 10.5 + the pass's 11.5 CPU seconds) / 1.15 cores = 20 s, then the routers' shard
    shared = replace(passing, prepass_beside=True, prepass_seconds=12.0, prepass_cpu_seconds=11.5,
                     cores_available=1.15)
    assert shared.seconds == pytest.approx(20 + 0.4)
    assert replace(shared, cores_available=None).seconds == pytest.approx(12 + 0.4)  # not measured: not counted
    # before the merge, the pass competes with the run's start-up only
    assert replace(shared, prepass_beside=False, prepass_cpu_seconds=1.3, cores_available=1.0).seconds \
        == pytest.approx(12 + 10 + 0.5)


def test_compute_and_disk_work_add_up_where_the_engine_fills_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.analyses.estimate import estimate as est

    monkeypatch.setattr(est.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert est.cores_are_shared()
    monkeypatch.setattr(est.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert not est.cores_are_shared()


def test_run_refuses_before_writing_what_plan_says_will_not_fit(tmp_path: Path, make: ModelFactory,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """run wrote three shards to a disk plan knew was too small, then stopped on ENOSPC (exit 3)."""
    from resumerge.merge.engine import outdir

    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    out = tmp_path / "out"
    free = api.plan_merge(cfg, settings=api.Settings(output=api.Output(out_shard_size="30k"))).total_bytes - 1
    assert not api.estimate(cfg, out, probe_size=0, disk_free=lambda path: free,
                            settings=api.Settings(output=api.Output(out_shard_size="30k"))).fits
    monkeypatch.setattr(outdir, "free_bytes", lambda path: free)
    assert main(["run", str(cfg), str(out), "--out-shard-size", "30k", "--quiet"]) == 2
    assert "the output needs" in capsys.readouterr().err
    assert not out.exists()


def test_the_ram_estimate_counts_small_tensors_by_the_groups_the_engine_admits(tmp_path: Path) -> None:
    """Consecutive tiny tensors of one shard are admitted as one group (resumerge.merge.engine.unitgroup): the working
    set counts what a group holds, not one tensor's estimate per worker."""
    plan = api.plan_merge(many_layer_merge(tmp_path, 20),
                          settings=api.Settings(output=api.Output(out_shard_size="20k")))
    budget, tensors = 1 << 30, [plan.tensors[n] for s in plan.shards for n in s.tensors]
    units = pending_units(plan, plan.shards, budget)
    each = [unit_bytes(tp, plan.method_of(tp), WHOLE) for tp in tensors]
    assert sum(size for size, _ in units) == sum(each) and not any(chunked for _, chunked in units)
    assert len(plan.shards) < len(units) <= -(-len(tensors) // GROUP_UNITS) + len(plan.shards)
    assert max(size for size, _ in units) <= group_bytes(budget)
    alone = working_set([(size, False) for size in each], budget, 2)
    assert working_set(units, budget, 2) == max(a + b for (a, _), (b, _) in itertools.pairwise(units)) > alone


def test_a_decomposition_timed_per_shape_is_one_compute_line(tmp_path: Path, make: ModelFactory,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """tsv is timed by one whole call per shape class: six classes printed six near-identical ``note compute``
    lines (issue 71, item 5); now one, its tensors the method's, and --json keeps each group."""
    a, b = make("a", seed=1), make("b", seed=2)
    config = write_config(tmp_path / "tsv.yml", {"merge_method": "tsv", "base_model": str(a),
                                                 "models": [{"model": str(a)}, {"model": str(b)}]})
    assert main(["plan", str(config), str(tmp_path / "out"), "--probe-size", "0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "compute: tsv" in line]
    assert len(lines) == 1, lines
    assert "timed on one call per shape" in lines[0]
    estimate = api.estimate(config, tmp_path / "out", probe_size=0)
    assert isinstance(estimate, Estimate)
    groups = [g for g in estimate.time.compute if g.method == "tsv"]
    assert len(groups) > 1 and f"for {sum(g.tensors for g in groups)} tensor(s)" in lines[0], lines[0]
