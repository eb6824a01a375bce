"""``check --executor ray`` of models whose vocabularies differ (issue 70): each actor reads the texts as its own ids
and the heads compare over the shared tokens, as a local check does: the same report, the shared count with it.

Tiny generated models (two layers, width 32, a byte-level tokenizer) on a real cluster on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from raycluster import RayHead, ray_cluster
from support import one_thread

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.merge.engine.executors import RayExecutor

pytest.importorskip("transformers")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
RAY_SPARE_NODES = True  # tests/conftest.py: this module runs beside the others that take spare nodes


def test_a_check_on_ray_of_models_whose_vocabularies_differ_is_the_local_check(tmp_path: Path,
                                                                                 ray_head: RayHead) -> None:
    base = make_model(tmp_path / "base", SPEC, seed=0)
    parent = make_model(tmp_path / "parent", SPEC, seed=1)
    merge = make_model(tmp_path / "merge", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=80), seed=2)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world again\n")
    with one_thread():
        local = api.check(merge, base=base, parents=[parent], prompts=texts,
                          settings=api.Settings(state_dir=tmp_path / "local"))
    assert local.shared_tokens == 64
    with ray_cluster(ray_head, workers=3, spare=True) as (cluster, _), one_thread():  # the count the check records
        on_ray = api.check(merge, base=base, parents=[parent], prompts=texts,
                           settings=api.Settings(state_dir=tmp_path / "ray", executor=RayExecutor(cluster.address)))
    found, expected = on_ray.to_json(), json.loads(json.dumps(local.to_json()))
    assert Path(found.pop("chart")).read_bytes() == Path(expected.pop("chart")).read_bytes()
    assert found == expected
