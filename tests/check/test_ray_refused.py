"""``check --executor ray`` on a cluster whose nodes cannot hold a model's actor (the memory each declares) is refused
in one line, exit 2, before any weight is read.

Its one worker node declares too little memory, so it cannot be one of the spare nodes the Ray check modules share
(tests/raycluster.py): in their modules (``RAY_SPARE_NODES``), which run first, it removed the spare nodes the tests
before left, and the next test started them and their kept workers again (about 14 CPU s and 20 s). This module takes
no spare node: tests/conftest.py runs it after those modules, where the spare nodes go anyway (the next Ray test
starts nodes of its own). Tiny generated models: one checked against another as its base."""

from __future__ import annotations

from pathlib import Path

import pytest
from raycluster import RayHead, ray_cluster

from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)


def test_a_cluster_whose_nodes_cannot_hold_a_model_s_actor_is_refused_before_any_weight_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], ray_head: RayHead) -> None:
    """Each actor declares the memory its step holds (torch's imports, a layer in float32, hidden states, heads):
    on nodes that declare less to Ray, the check says so in one line, exit 2, and reads no weight."""
    from resumerge.cli.commands import main

    merge, base = (make_model(tmp_path / role, SPEC, seed=seed) for role, seed in (("merge", 1), ("base", 0)))
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world again\nx\n")
    state = tmp_path / "checked"
    with ray_cluster(ray_head, workers=1, memory=256 << 20) as (cluster, _):
        code = main(["check", str(merge), "--base", str(base), "--prompts", str(texts), "--executor", "ray",
                     "--ray-address", cluster.address, "--state-dir", str(state)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "a model's actor of the check needs" in err[0] and "more than any node of the cluster has" in err[0], err
    assert not list(state.rglob("static*.json")) and not list(state.rglob("layer-*"))  # nothing read
