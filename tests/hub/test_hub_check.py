"""``resumerge check hf://NAMESPACE/NAME`` (and ``--base``/``--parent hf://...``) on the stand-in hub: the models'
small files come into the cache, their weights are read by HTTP Range, never downloaded whole, and the report is
the one the same models give as local folders. A resumerge output whose hub input was streamed is checked against
that input by range too; a resumerge output on the hub names its parents in its manifest, and its model card is
left as committed, said in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub, files_of, iter_requests
from resumerge import api
from resumerge.check import CheckReport
from resumerge.cli.modelgen import make_model

pytest.importorskip("transformers")


def _figures(report: CheckReport) -> list[tuple[str, float | None, float | None, tuple[float, ...]]]:
    return [(m.role, m.nll, m.kl, m.drift) for m in report.models]


def _hub_weights_in_cache(home: Path) -> list[Path]:
    return [p for p in (home / "hub").rglob("*.safetensors")]


def test_hub_models_are_checked_by_range_like_local_folders(tmp_path: Path, hub: FakeHub, state: Path,
                                                            hf_env: Path, models: tuple[Model, Model]) -> None:
    merged = make_model(tmp_path / "merged", SPEC, seed=7)
    beta = make_model(tmp_path / "beta", SPEC, seed=1)
    hub.push("org/merged", files_of(merged))
    hub.push("org/beta", files_of(beta))
    local_alpha = tmp_path / "alpha"
    for name, data in models[0].files.items():
        if "/" not in name and name.endswith((".json", ".safetensors")):
            (local_alpha / name).parent.mkdir(parents=True, exist_ok=True)
            (local_alpha / name).write_bytes(data)
    hub.reset_counters()
    report = api.check("hf://org/merged", base=f"hf://{REPO}", parents=["hf://org/beta"], state_dir=state)
    assert [m.path for m in report.models] == ["hf://org/merged", f"hf://{REPO}", "hf://org/beta"]
    assert not _hub_weights_in_cache(hf_env)  # weights never downloaded: only configs, tokenizer, index
    ranged = [r for r in iter_requests(hub, "GET") if r.range and r.path.endswith(".safetensors")]
    assert ranged and all(not r.path.endswith(("pytorch_model.bin", "model.gguf")) for r in ranged)
    local = api.check(merged, base=local_alpha, parents=[beta], state_dir=tmp_path / "local-state")
    assert _figures(report)[1:] == _figures(local)[1:] and report.models[0].nll == local.models[0].nll
    assert report.verdict == local.verdict and report.static == local.static
    # A hub OUT is no folder of this machine: its card is left as committed, in one line.
    assert report.card is not None and "hf://org/merged" in report.card and "\n" not in report.card


def test_an_output_whose_hub_input_was_streamed_is_checked_against_it_by_range(
        tmp_path: Path, hub: FakeHub, state: Path, hf_env: Path) -> None:
    other = make_model(tmp_path / "other", SPEC, seed=3)
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {REPO}\n    parameters: {{weight: 0.5}}\n"
                      f"  - model: {other}\n    parameters: {{weight: 0.5}}\n")
    out = tmp_path / "out"
    api.run(config, out, state_dir=state, resources=api.Resources(stream_inputs=True))
    assert not _hub_weights_in_cache(hf_env)  # the merge streamed its hub input
    report = api.check(out, state_dir=state)  # its parents from its record: the hub input read by range again
    assert [m.role for m in report.models] == ["merge", "parent", "parent"]
    assert report.models[1].path.startswith(f"hf://{REPO}@") and report.models[2].path == str(other)
    assert report.verdict == "works" and all(m.nll is not None for m in report.models)
    assert api.verify(out, state_dir=state).ok  # the card's section recorded


def test_a_resumerge_output_on_the_hub_names_its_parents_and_keeps_its_card(tmp_path: Path, hub: FakeHub,
                                                                            state: Path) -> None:
    parents = [make_model(tmp_path / f"p{i}", SPEC, seed=i) for i in range(2)]
    config = tmp_path / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in parents))
    out = tmp_path / "out"
    api.run(config, out, state_dir=tmp_path / "merge-state")
    hub.push("org/merged-out", files_of(out))  # as published: the manifest (its record) beside the weights
    report = api.check("hf://org/merged-out", state_dir=state)  # base and parents from the repo's manifest
    assert [(m.role, m.path) for m in report.models] == [("merge", "hf://org/merged-out"),
                                                         *(("parent", str(p)) for p in parents)]
    assert report.verdict == "works"
    assert report.card is not None and "left as committed" in report.card  # no commit to the repo
