"""``ties`` and ``breadcrumbs`` (with and without ``rescale``) on tensors computed from row chunks: runs that a
whole-tensor unit could not fit complete, and every streamed output — under a tight budget, in passes at the
default budget, after a kill — is byte-identical to the whole-tensor run's.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch
from support import cli, digests, linear_config, write_config

from resumerge.analyses.estimate import estimate
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.hub.ranges import RangeClient
from resumerge.inputs.hub.stream import HubStream
from resumerge.inputs.source import InputSources, LocalFiles
from resumerge.machine.memory import FakeProbe
from resumerge.merge.engine import devices, footprint
from resumerge.merge.engine.compute import TensorCompute
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.engine.workspace import Workspace
from resumerge.merge.methods import get_method
from resumerge.merge.plan import workunits
from resumerge.merge.plan.merge_plan import PlanOptions

# bfloat16 inputs: equal magnitudes at the thresholds are common, so the chunked tie rules are exercised.
# A vocabulary of 4,000 (8,000 before: every merge's embeddings, three quarters of its work, twice as large) still
# cuts the embeddings into several chunks at every budget below, each budget half what it was with 8,000.
SPEC = ModelSpec(layers=1, hidden=512, intermediate=1024, vocab=4000, heads=8, kv_heads=8, shard_bytes=100_000_000,
                 tokenizer=False, dtype=torch.bfloat16)
SHARD = "4.5M"  # embed_tokens and lm_head (4.1 MB each) in shards of their own


@dataclass(frozen=True)
class Merge:
    root: Path
    configs: dict[str, Path]
    reference: dict[str, dict[str, str]]


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> Merge:
    root = tmp_path_factory.mktemp("streamed")
    a, b, c = (make_model(root / name, SPEC, seed=seed) for seed, name in enumerate("abc"))
    configs, reference = {}, {}
    with pytest.MonkeyPatch.context() as patch:
        # The reference holds every tensor whole: no method streams.
        patch.setattr(workunits, "row_stream", lambda *args: None)
        for method in ("ties", "breadcrumbs", "dare_ties", "della"):
            configs[method], configs[f"{method}-rescale"] = _configs(root, method, a, b, c)
            for name in (method, f"{method}-rescale") if method in ("ties", "breadcrumbs") else (method,):
                out = root / f"reference-{name}"
                assert _run(configs[name], out, root / "state-ref") == 0
                reference[name] = digests(out)
        configs["sce"] = write_config(root / "sce.yml", {
            "merge_method": "sce", "base_model": str(a), "models": [{"model": str(b)}, {"model": str(c)}],
            "parameters": {"select_topk": 0.4}})
        assert _run(configs["sce"], root / "reference-sce", root / "state-ref") == 0
        reference["sce"] = digests(root / "reference-sce")
    configs["linear"] = write_config(root / "linear.yml", linear_config(a, b))
    assert _run(configs["linear"], root / "reference-linear", root / "state-ref") == 0
    reference["linear"] = digests(root / "reference-linear")
    return Merge(root, configs, reference)


def _configs(root: Path, method: str, a: Path, b: Path, c: Path) -> tuple[Path, Path]:
    doc: dict[str, object] = {
        "merge_method": method, "base_model": str(a),
        "models": [{"model": str(b), "parameters": {"weight": 0.6, "density": 0.3, "gamma": 0.02}},
                   {"model": str(c), "parameters": {"weight": 0.4, "density": 0.5, "gamma": 0.02}}]}
    rescale = doc | {"parameters": {"rescale": True}}
    return write_config(root / f"{method}.yml", doc), write_config(root / f"{method}-rescale.yml", rescale)


def _run(config: Path, out: Path, state: Path, *options: str) -> int:
    return main(["run", str(config), str(out), "--quiet", "--state-dir", str(state), "--out-shard-size", SHARD,
                 *options])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of the engine's compute steps during the test: ``row_chunks``, a stream's output rows short of its
    whole tensor (streamed to the writer); ``in_passes``, tensors computed whole by their stream; ``unstreamed``,
    tensors or row chunks computed without a stream (by the method's function, or copied)."""
    counts = {"row_chunks": 0, "in_passes": 0, "unstreamed": 0}
    rows, rows_then, whole = TensorCompute.rows, TensorCompute.rows_then, TensorCompute.whole

    def count(self: TensorCompute, first: int, stop: int) -> None:
        if self.stream is None:
            counts["unstreamed"] += 1
        elif (first, stop) != (0, self.total):
            counts["row_chunks"] += 1

    def counted_rows(self: TensorCompute, first: int, stop: int,
                     workspace: Workspace | None = None) -> dict[str, torch.Tensor]:
        count(self, first, stop)
        return rows(self, first, stop, workspace)

    def counted_rows_then(self: TensorCompute, first: int, stop: int) -> Callable[[], dict[str, torch.Tensor]]:
        count(self, first, stop)  # a chunk streamed to the writer: merged here, encoded on a worker
        return rows_then(self, first, stop)

    def counted_whole(self: TensorCompute, workspace: Workspace | None = None) -> dict[str, torch.Tensor]:
        counts["in_passes"] += self.stream is not None
        return whole(self, workspace)

    monkeypatch.setattr(TensorCompute, "rows", counted_rows)
    monkeypatch.setattr(TensorCompute, "rows_then", counted_rows_then)
    monkeypatch.setattr(TensorCompute, "whole", counted_whole)
    yield counts


# What the scripted probe says the process holds before any tensor: every budget below is relative to it, so the
# test does not depend on this process's real RSS.
BASELINE = 10_000_000


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's and the plan's memory readings come from a fixed probe, and the process's own baseline (what the
    budget counts beside the work) is BASELINE, in both (and plan times no compute)."""
    monkeypatch.setattr(footprint, "fresh_baseline", lambda *args: BASELINE)
    monkeypatch.setattr(footprint, "run_overhead", lambda plan: 0)
    monkeypatch.setattr(devices, "SystemProbe", lambda: FakeProbe(rss=BASELINE))
    monkeypatch.setattr(estimate, "SystemProbe", lambda: FakeProbe(rss=BASELINE))
    monkeypatch.setattr(estimate, "start_compute", lambda *args, **kwargs: tuple)


def _whole_tensor_need(config: Path, capsys: pytest.CaptureFixture[str]) -> int:
    """The smallest budget ``plan`` names for ``config`` when its tensors are held whole (no stream)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workunits, "row_stream", lambda *args: None)
        main(["plan", str(config), "--max-memory", "1MB", "--json", "--probe-size", "0"])
    return int(json.loads(capsys.readouterr().out)["memory"]["smallest_budget"])


def _quarter_of_whole(merge: Merge, capsys: pytest.CaptureFixture[str]) -> str:
    """A budget with room for a quarter of the whole-tensor embeddings' unit (of ties with rescale): about the room an
    eighth left with 8,000 tokens (an eighth of 4,000 tokens' is under a row chunk's fixed part)."""
    need = _whole_tensor_need(merge.configs["ties-rescale"], capsys)
    return str(BASELINE + (need - BASELINE) // 4)


@pytest.mark.usefixtures("scripted")
@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_a_budget_too_small_for_whole_tensors_streams_rows_with_the_same_bytes(
        merge: Merge, calls: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    # With room for a quarter of the embeddings' whole unit, a whole-tensor merge would be refused, and the
    # streamed one has too little even for a tensor's output in one piece (its unit in passes): row chunks go to
    # the writer. With rescale too: its L1 norms are ordered sums fed in a statistics pass of their own.
    budget = _quarter_of_whole(merge, capsys)
    for method in ("ties", "breadcrumbs", "ties-rescale", "breadcrumbs-rescale"):
        tag = f"tight-{method}"
        main(["plan", str(merge.configs[method]), "--max-memory", budget, "--json", "--probe-size", "0"])
        memory = json.loads(capsys.readouterr().out)["memory"]
        assert memory["smallest_budget"] <= int(budget)
        # Streamed in rows, the embeddings fill the room the budget leaves, never more.
        assert memory["working_set_bytes"] <= int(budget) - BASELINE
        assert _run(merge.configs[method], merge.root / tag, merge.root / "st", "--max-memory", budget) == 0
        assert digests(merge.root / tag) == merge.reference[method]
    assert calls["row_chunks"] > 10  # row chunks, not whole tensors


@pytest.mark.usefixtures("scripted")
@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_dare_della_and_sce_stream_only_what_does_not_fit_whole_with_the_same_bytes(
        merge: Merge, calls: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    # Their streams are slower than the whole tensor, so at the default budget nothing streams; under a budget a
    # quarter of the whole embeddings' unit, the masks are drawn chunk by chunk from per-task-vector generators and
    # the rescale's norms summed in order (rescale on: their default), and SCE's variance window and energies are
    # taken over chunks: the same bytes as the whole-tensor run.
    budget = _quarter_of_whole(merge, capsys)
    for method in ("dare_ties", "della", "sce"):
        assert _run(merge.configs[method], merge.root / f"default-{method}", merge.root / "st") == 0
        assert digests(merge.root / f"default-{method}") == merge.reference[method]
        assert calls["row_chunks"] == calls["in_passes"] == 0
        assert _run(merge.configs[method], merge.root / f"tight-{method}", merge.root / "st",
                    "--max-memory", budget) == 0
        assert digests(merge.root / f"tight-{method}") == merge.reference[method]
        assert calls["row_chunks"] > 10
        calls["row_chunks"] = calls["in_passes"] = 0


@pytest.mark.usefixtures("scripted")
def test_elementwise_tensors_still_stream_rows_under_a_tight_budget(merge: Merge, calls: dict[str, int]) -> None:
    # The embeddings' linear unit (about 30 MB) is over a quarter of this budget: its rows stream as before.
    out = merge.root / "tight-linear"
    assert _run(merge.configs["linear"], out, merge.root / "st", "--max-memory", str(BASELINE + 45_000_000)) == 0
    assert digests(out) == merge.reference["linear"]
    assert calls["unstreamed"] > 12 + 2  # 12 tensors, the embeddings and head in several row chunks each


@pytest.mark.usefixtures("scripted")
def test_passes_at_the_default_budget_give_the_same_bytes(merge: Merge, calls: dict[str, int],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # Chunk kernels run serially, so passes are chosen where the engine's two workers fill torch's threads:
    # one thread here (-j 1, as a user pins it), whatever this machine's cores: patching get_num_threads reached
    # nothing once resumerge's lazy torch had looked it up, so a 16-core machine (16 threads) planned no passes.
    # Every 2-D tensor then streams, over chunks of 1 to 20 rows; the 1-D norms (one chunk) are held whole.
    monkeypatch.setattr(workunits, "CHUNK_ELEMENTS", 10_000)
    before = torch.get_num_threads()
    try:
        largest = {}
        for config in ("ties", "ties-rescale"):
            main(["plan", str(merge.configs[config]), "--json", "--probe-size", "0", "-j", "1"])
            largest[config] = json.loads(capsys.readouterr().out)["memory"]["largest_unit_bytes"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(workunits, "row_stream", lambda *args: None)
            main(["plan", str(merge.configs["ties"]), "--json", "--probe-size", "0", "-j", "1"])
            whole = json.loads(capsys.readouterr().out)["memory"]["largest_unit_bytes"]
        # A unit in passes holds a chunk and its output; the whole embeddings' unit needs several times that.
        assert largest["ties"] * 3 < whole == largest["ties-rescale"]  # a rescale streams only what cannot fit whole
        for method in ("ties", "breadcrumbs"):
            out = merge.root / f"passes-{method}"
            assert _run(merge.configs[method], out, merge.root / "st", "-j", "1") == 0
            assert digests(out) == merge.reference[method]
    finally:
        torch.set_num_threads(before)
    assert calls["in_passes"] >= 2 * 9  # every 2-D tensor of both merges


def test_a_kill_while_streaming_resumes_to_the_same_bytes(merge: Merge) -> None:
    # A fresh process (one torch thread, so that streams run at any core count) dies once the first tensor of a
    # shard, streamed in passes, is written; resume rewrites that shard.
    out, state = merge.root / "killed", merge.root / "st-killed"
    killed = cli("run", merge.configs["ties"], out, "--quiet", "--state-dir", state, "--out-shard-size", SHARD,
                 "--num-threads", "1", env={"RESUMERGE_KILL_AT": "mid_shard_write:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert main(["resume", str(out), "--quiet", "--state-dir", str(state)]) == 0
    assert digests(out) == merge.reference["ties"]


def test_the_rule_streams_what_it_can_and_reads_hub_ranges_once_when_it_has_the_choice(tmp_path: Path) -> None:
    # The module's models and TIES configs, but not its reference merges (``merge``): the rule reads plans only, and
    # where the suite's workers split the module, the worker that takes this test would make all eight merges.
    models = tmp_path / "models"
    a, b, c = (make_model(models / name, SPEC, seed=seed) for seed, name in enumerate("abc"))
    ties, ties_rescale = _configs(models, "ties", a, b, c)
    plan = plan_from_config(load_config_text(ties.read_text()), PlanOptions())
    rescaled = plan_from_config(load_config_text(ties_rescale.read_text()), PlanOptions())
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    method = get_method("ties")
    assert method is not None
    default, fair, tight = 10**12, 50_000_000, 10_000_000
    mode = workunits.unit_mode
    assert mode(plan.tensors[embed], method, default, "cpu") == workunits.PASSES
    assert mode(plan.tensors[embed], method, fair, "cpu") == workunits.PASSES  # a chunk and the 4 MB output
    assert mode(plan.tensors[embed], method, tight, "cpu") == workunits.ROWS
    assert mode(plan.tensors[norm], method, default, "cpu") == workunits.WHOLE  # one chunk: nothing to gain
    # A rescale streams too, but only what cannot fit whole (its norm pass reads the inputs once more).
    assert mode(rescaled.tensors[embed], method, default, "cpu") == workunits.WHOLE
    assert mode(rescaled.tensors[embed], method, tight, "cpu") == workunits.ROWS
    assert mode(plan.tensors[embed], method, default, "cuda:0") == workunits.WHOLE  # streams run on the CPU
    assert mode(plan.tensors[embed], method, default, "cpu", serial=False) == workunits.WHOLE  # cores to use
    assert mode(plan.tensors[embed], method, fair, "cpu", serial=False) == workunits.ROWS
    # An input streamed from the hub would be fetched again by every pass: held whole unless it cannot fit.
    assert mode(plan.tensors[embed], method, default, "cpu", rereadable=False) == workunits.WHOLE
    assert mode(plan.tensors[embed], method, fair, "cpu", rereadable=False) == workunits.ROWS
    hub = HubStream(tmp_path, {"model.safetensors": cast(RangeClient, object())})
    sources = InputSources({"hub": hub, "local": LocalFiles(tmp_path)})
    try:
        assert not sources.rereads_cheaply("hub", "model.safetensors")
        assert sources.rereads_cheaply("hub", "other.safetensors")  # downloaded: read from the cache
        assert sources.rereads_cheaply("local", "model.safetensors")
    finally:
        sources.close()
