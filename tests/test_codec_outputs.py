"""Outputs in a stored format: the output keeps the base model's format (its tensors written as several stored parts,
each where the safetensors layout puts it), or every tensor plain with ``--dequantize``; a run killed at any point
resumes byte-identical. Tested with the toy "int8 with a per-row scale" format of ``toycodec``.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from safetensors.torch import load_file, save
from support import cli, cli_start, digests, linear_config, write_config
from toycodec import TOY, RowScaledInt8, quantize

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.config.settings import RunSettings
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import MAIN, PLAIN, CodecTable
from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.safetensors_format import DTYPE_SIZES, layout_shard, numel
from resumerge.inputs.source import InputSources
from resumerge.machine.checksums import XXH3_128
from resumerge.merge.engine import compute, session
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.engine.session import run_plan
from resumerge.merge.engine.target import Target
from resumerge.merge.methods.registry import get_method
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import Plan, PlanOptions, fingerprint_parts
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.roles import formats_line, formats_report, quantized
from resumerge.merge.plan.workunits import chunk_plan, row_stream
from resumerge.merge.store.shardwriter import ShardWriter
from resumerge.merge.store.sink import LocalDirSink

TOYRUN = Path(__file__).with_name("toyrun.py")


def plan_for(tmp_path: Path, doc: dict[str, object], codecs: CodecTable,
             options: PlanOptions | None = None) -> tuple[Plan, str]:
    text = write_config(tmp_path / "c.yml", doc).read_text()
    config = load_config_text(text)
    return build_plan(config, open_inputs(config).models, options or PlanOptions(), codecs), text


def _loaded(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def _as_saved(file: Path) -> bytes:
    """The bytes safetensors itself writes for the tensors of ``file`` (the layout the writer must reproduce)."""
    return save(load_file(file), metadata={"format": "pt"})


def test_the_output_keeps_the_base_model_s_format_each_part_at_its_place(tmp_path: Path, make: ModelFactory) -> None:
    b, a = make("b", seed=2), make("a", seed=1)
    decoded = quantize(b)
    plan, text = plan_for(tmp_path, linear_config(b, a, weights=(0.75, 0.25)), TOY,
                          PlanOptions(out_shard_size=20_000))
    assert len(plan.shards) > 2
    for name, tp in plan.tensors.items():
        toy = name in decoded  # the first model's format (no base_model): its quantized tensors stay quantized
        assert tp.out_codec == (RowScaledInt8() if toy else PLAIN), name
        assert tp.nbytes == (tp.shape[0] * (tp.shape[1] + 4) if toy else numel(tp.shape) * DTYPE_SIZES[tp.out_dtype])
        if toy:
            assert chunk_plan(tp, 1, 3).nbytes == 2 * tp.shape[1] + 2 * 4
    assert plan.out_config["quantization_config"] == {"quant_method": RowScaledInt8.name}

    out = tmp_path / "out"
    settings = RunSettings()
    run_plan(Prepared(plan), text, Target.open(out, settings), settings)
    for file in out.glob("*.safetensors"):
        assert file.read_bytes() == _as_saved(file), file.name  # every part at safetensors' own place
    merged = _loaded(out)
    assert set(merged) == set(plan.tensors) | {f"{n}_scale" for n in decoded}
    originals = _loaded(a)
    for name, value in decoded.items():
        expected = value * 0.75 + originals[name] * 0.25
        got = RowScaledInt8().decode({MAIN: merged[name], "scale": merged[f"{name}_scale"]}, 0)
        torch.testing.assert_close(got, expected, rtol=0, atol=float(merged[f"{name}_scale"].max()) * 0.51)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {"quant_method": "toy-int8"}


def test_dequantize_writes_every_tensor_plain_without_the_quantization_config(tmp_path: Path,
                                                                            make: ModelFactory) -> None:
    b, a = make("b", seed=2), make("a", seed=1)
    quantize(b)
    kept, _ = plan_for(tmp_path, linear_config(b, a), TOY)
    plain, text = plan_for(tmp_path, linear_config(b, a), TOY, PlanOptions(dequantize=True))
    assert {tp.out_codec for tp in plain.tensors.values()} == {PLAIN}
    assert all(tp.nbytes == tp.shape[0] * tp.shape[1] * 4 for tp in plain.tensors.values() if len(tp.shape) == 2)
    assert "quantization_config" not in plain.out_config and "quantization_config" in kept.out_config
    assert fingerprint_parts(plain)["options"] != fingerprint_parts(kept)["options"]
    out = tmp_path / "out"
    settings = RunSettings()
    run_plan(Prepared(plain), text, Target.open(out, settings), settings)
    assert set(_loaded(out)) == set(plain.tensors)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_a_plain_merge_s_plan_is_unchanged_by_the_dequantize_option(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    plain, _ = plan_for(tmp_path, linear_config(a, b), TOY)
    dequantized, _ = plan_for(tmp_path, linear_config(a, b), TOY, PlanOptions(dequantize=True))
    assert fingerprint_parts(plain)["plan"] == fingerprint_parts(dequantized)["plan"]
    # Recorded in the fingerprint only when set: a run recorded before the option existed resumes.
    assert fingerprint_parts(plain)["options"] == fingerprint_parts(replace(plain, options=PlanOptions()))["options"]


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_parts_written_in_row_chunks_land_at_their_places(tmp_path: Path, rows: int) -> None:
    torch.manual_seed(0)
    codec = RowScaledInt8()
    values = {"a.weight": torch.randn(10, 6), "b.norm": torch.randn(6), "c.weight": torch.randn(5, 3)}
    stored: dict[str, tuple[str, ...]] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if value.dim() == 2:
            parts = codec.encode(value, "F32")
            expected |= {name: parts[MAIN], f"{name}_scale": parts["scale"]}
            stored[name] = (name, f"{name}_scale")
        else:
            expected[name], stored[name] = value, (name,)
    layout = layout_shard({n: (("I8" if t.dtype == torch.int8 else "F32"), tuple(t.shape))
                           for n, t in expected.items()})
    sink = LocalDirSink(tmp_path)
    writer = ShardWriter(sink, "model.safetensors", layout, stored, checksum=XXH3_128)
    for name, parts in stored.items():
        total = expected[name].shape[0] if len(parts) > 1 else 1
        for first in range(0, total, rows):
            chunk = {p: expected[p][first:first + rows] if len(parts) > 1 else expected[p] for p in parts}
            done = writer.write(name, chunk)
            assert done == (first + rows >= total)
    writer.finish()
    file = tmp_path / "model.safetensors"
    assert file.read_bytes() == save(expected, metadata={"format": "pt"})


def test_a_tensor_s_parts_come_together_in_the_shard_s_order(tmp_path: Path) -> None:
    layout = layout_shard({"w": ("I8", (2, 2)), "w_scale": ("F32", (2,))})
    writer = ShardWriter(LocalDirSink(tmp_path), "model.safetensors", layout, {"w": ("w", "w_scale")},
                         checksum=XXH3_128)
    with pytest.raises(Exception, match="came as"):
        writer.write("w", {"w": torch.zeros(2, 2, dtype=torch.int8)})
    writer.abort()


def test_a_streamed_method_s_rows_are_encoded_part_by_part(tmp_path: Path, make: ModelFactory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compute, "pass_rows", lambda tp: 3)  # chunks of 3 rows, each encoded on its own
    base, a, b = make("base", seed=0), make("a", seed=1), make("b", seed=2)
    quantize(base)
    doc = {"merge_method": "ties", "base_model": str(base),
           "models": [{"model": str(a), "parameters": {"weight": 0.6, "density": 0.3}},
                      {"model": str(b), "parameters": {"weight": 0.4, "density": 0.5}}]}
    plan, _ = plan_for(tmp_path, doc, TOY)
    ties = get_method("ties")
    assert ties is not None
    streamed = [tp for tp in plan.tensors.values() if not tp.out_codec.plain]
    assert streamed
    with InputSources.local(plan.model_dirs) as sources:
        for tp in streamed:
            stream = row_stream(tp, ties, "cpu")
            assert stream is not None
            whole = compute_tensor(plan, tp, sources, NO_RESOURCES)
            assert set(whole) == {tp.name, f"{tp.name}_scale"}
            with serial_kernels():  # a stream's chunk kernels, as the engine runs them
                rows = compute_tensor(plan, tp, sources, NO_RESOURCES, stream)
            assert {k: v.dtype for k, v in rows.items()} == {k: v.dtype for k, v in whole.items()}
            assert all(torch.equal(rows[k], whole[k]) for k in whole), tp.name


@pytest.fixture(scope="module")
def toy_merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A linear merge of two toy-quantized models, its output in the first one's format over several shards
    (codes and scales of a tensor far apart in each), and the digests of an uninterrupted run of it."""
    root = tmp_path_factory.mktemp("toykill")
    spec = ModelSpec(layers=6, hidden=64, intermediate=96)
    b, a = make_model(root / "b", spec, seed=2), make_model(root / "a", spec, seed=1)
    quantize(b)
    quantize(a)
    config = write_config(root / "merge.yml", linear_config(b, a, weights=([0.2, 0.8], 0.5)))
    with pytest.MonkeyPatch.context() as patch:
        _toy_runs(patch)
        ref = root / "reference"
        assert main(["run", str(config), str(ref), "--state-dir", str(root / "ref-state"), "--out-shard-size",
                     TOY_SHARD, "--quiet"]) == 0
    assert any(n.endswith("_scale") for n in _loaded(ref))
    return config, digests(ref)


def _toy_runs(patch: pytest.MonkeyPatch) -> None:
    """Plan this process's runs with the toy format, as ``toyrun`` plans its process's."""
    patch.setattr(session, "build_plan", partial(build_plan, codecs=TOY))


TOY_SHARD = "60k"


@pytest.mark.parametrize("point", ["mid_shard_write:1", "mid_shard_write:3", "after_temp_write:3", "after_fsync:2",
                                   "after_rename:2", "after_ledger_commit:2", "random:0.3", "random:0.9"])
def test_a_run_with_multi_part_outputs_killed_anywhere_resumes_byte_identical(
        toy_merge: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    config, reference = toy_merge
    out, state = tmp_path / "out", tmp_path / "state"
    # `python toyrun.py ARGS`, forked from the worker's fork server (torch imported once) as support.cli forks the CLI
    args = ["run", config, out, "--state-dir", state, "--out-shard-size", TOY_SHARD, "--quiet"]
    where, _, arg = point.partition(":")
    if where != "random":
        killed = cli(*args, env={"RESUMERGE_KILL_AT": point}, script=TOYRUN)
        assert killed.returncode == -signal.SIGKILL, f"{point} was never reached: {killed.stderr}"
    else:  # a moment of the merge: once that fraction of its shards is published (never the last), then at once
        shards = sorted(n for n in reference if n.endswith(".safetensors"))
        wanted = max(1, min(len(shards) - 1, round(float(arg) * len(shards))))
        proc = cli_start(*args, script=TOYRUN)
        while sum((out / n).exists() for n in shards) < wanted and proc.poll() is None:
            time.sleep(0.002)
        # Counted in shards, not seconds: on a loaded machine a fixed delay outlived the whole run.
        assert proc.poll() is None, "the run ended before it was killed"
        proc.kill()
        proc.wait()
    _toy_runs(monkeypatch)
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == reference
    assert main(["verify", str(out), "--state-dir", str(state)]) == 0


def test_a_tensor_taken_whole_from_one_input_is_copied_in_its_stored_format(tmp_path: Path, make: ModelFactory,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    b, a = make("b", seed=2), make("a", seed=1)
    decoded = quantize(b)
    stored_b = _loaded(b)
    stack = {"merge_method": "passthrough", "slices": [{"sources": [{"model": str(b), "layer_range": [0, 3]}]},
                                                       {"sources": [{"model": str(b), "layer_range": [1, 3]}]}]}
    one_hot = linear_config(b, a, weights=(1, 0))
    (tmp_path / "p").mkdir()
    stacked, stack_text = plan_for(tmp_path / "p", stack, TOY)
    picked, picked_text = plan_for(tmp_path, one_hot, TOY)
    assert {n for n, tp in picked.tensors.items() if tp.copy_of == 0} == set(decoded)
    assert all(tp.copy_of is None for tp in picked.tensors.values() if tp.out_codec.plain)
    mixed = plan_for(tmp_path, linear_config(b, a, weights=(0.5, 0.5)), TOY)[0]
    assert all(tp.copy_of is None for tp in mixed.tensors.values())
    # Copies are never decoded nor encoded: their codes and scales are the stored ones, byte for byte.
    monkeypatch.setattr(RowScaledInt8, "decode", lambda *a: pytest.fail("a copied tensor was decoded"))
    monkeypatch.setattr(RowScaledInt8, "encode", lambda *a: pytest.fail("a copied tensor was re-encoded"))
    settings = RunSettings()
    for plan, text, name in ((stacked, stack_text, "stacked"), (picked, picked_text, "picked")):
        out = tmp_path / name
        run_plan(Prepared(plan), text, Target.open(out, settings), settings)
        merged = _loaded(out)
        for out_name, tp in plan.tensors.items():
            if tp.copy_of is None:
                continue
            source = tp.inputs[tp.copy_of].tensor
            for suffix in ("", "_scale"):
                assert merged[out_name + suffix].dtype == stored_b[source + suffix].dtype
                assert torch.equal(merged[out_name + suffix], stored_b[source + suffix]), out_name + suffix
    assert sum(tp.copy_of is not None for tp in stacked.tensors.values()) > len(decoded)  # a layer used twice


def test_plan_reports_each_model_s_and_the_output_s_format_and_roles(tmp_path: Path, make: ModelFactory) -> None:
    b, a = make("b", seed=2), make("a", seed=1)
    decoded = quantize(b)
    plan, _ = plan_for(tmp_path, linear_config(b, a), TOY)
    report = formats_report(plan)
    n, others = len(decoded), len(plan.tensors) - len(decoded)
    assert report["inputs"][str(b)] == {"format": "toy-int8", "roles": {"weight": n, "companion": n, "other": others}}
    assert report["inputs"][str(a)]["format"] == "plain"
    assert report["output"] == {"format": "toy-int8", "roles": {"weight": n, "companion": n, "other": others}}
    assert quantized(report)
    dequantized = formats_report(plan_for(tmp_path, linear_config(b, a), TOY, PlanOptions(dequantize=True))[0])
    assert dequantized["output"] == {"format": "plain",
                                     "roles": {"weight": 0, "companion": 0, "other": len(plan.tensors)}}
    (tmp_path / "p").mkdir()
    assert not quantized(formats_report(plan_for(tmp_path / "p", linear_config(a, a), TOY)[0]))
    line = formats_line(report)
    assert f"{b}: toy-int8 ({n} weight, {n} companion, {others} other)" in line
    assert line.endswith(f"output: toy-int8 ({n} weight, {n} companion, {others} other)")
