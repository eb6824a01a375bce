"""A format's companions read by HTTP Range like any tensor: a toy-format model and a block-FP8 one streamed from
the stand-in hub, their scales in a shard of their own, merge to the bytes the same model gives from a local
folder."""

from __future__ import annotations

from pathlib import Path

from quantmodels import fp8, fp8_config, quantize_model
from support import digests, linear_config, write_config
from toycodec import SCALES_FILE, TOY, quantize

from hub.fakehub import FakeHub, files_of
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import load_config_text
from resumerge.config.settings import RunSettings
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.merge.engine.session import run_plan
from resumerge.merge.engine.target import Target
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.prepared import Prepared

TOY_REPO = "org/toy"
FP8_REPO = "org/fp8"


def _run(tmp_path: Path, doc: dict[str, object], out: Path, state: Path, codecs: CodecTable = TOY) -> None:
    text = write_config(tmp_path / f"{out.name}.yml", doc).read_text()
    config = load_config_text(text)
    settings = RunSettings(state=StateDir.resolve(state))
    inputs = open_inputs(config, state=StateDir.resolve(state))
    plan = build_plan(config, inputs.models, PlanOptions(stream_inputs=True), codecs)
    run_plan(Prepared(plan, inputs), text, Target.open(out, settings), settings)


def test_companions_stream_by_range_from_another_shard(tmp_path: Path, hub: FakeHub, state: Path) -> None:
    a = make_model(tmp_path / "a", ModelSpec(), seed=1)
    b = make_model(tmp_path / "b", ModelSpec(), seed=2)
    quantize(b)
    hub.push(TOY_REPO, files_of(b))
    _run(tmp_path, linear_config(a, b), tmp_path / "local", state)
    hub.reset_counters()
    _run(tmp_path, linear_config(a, Path(TOY_REPO)), tmp_path / "streamed", state)
    weights = {k: v for k, v in digests(tmp_path / "local").items() if k.endswith(".safetensors")}
    assert weights == {k: v for k, v in digests(tmp_path / "streamed").items() if k.endswith(".safetensors")}
    # The scales were read from their own file, every byte of it once (its header and its one range).
    assert hub.file_bytes()[f"{TOY_REPO}/{SCALES_FILE}"] == (b / SCALES_FILE).stat().st_size


def test_a_block_fp8_model_streamed_by_range_gives_the_local_bytes(tmp_path: Path, hub: FakeHub,
                                                                   state: Path) -> None:
    spec = ModelSpec(layers=2, hidden=40, intermediate=56, shard_bytes=20_000)
    a = make_model(tmp_path / "a", spec, seed=1)
    b = make_model(tmp_path / "b", spec, seed=2)
    quantize_model(b, tmp_path / "b-decoded", fp8((16, 16)), fp8_config((16, 16)))
    hub.push(FP8_REPO, files_of(b))
    _run(tmp_path, linear_config(a, b), tmp_path / "local", state, CODECS)
    hub.reset_counters()
    _run(tmp_path, linear_config(a, Path(FP8_REPO)), tmp_path / "streamed", state, CODECS)
    weights = {k: v for k, v in digests(tmp_path / "local").items() if k.endswith(".safetensors")}
    assert weights == {k: v for k, v in digests(tmp_path / "streamed").items() if k.endswith(".safetensors")}
    # Every scale was read by range from the scales' shard, each byte of it once.
    assert hub.file_bytes()[f"{FP8_REPO}/{SCALES_FILE}"] == (b / SCALES_FILE).stat().st_size
