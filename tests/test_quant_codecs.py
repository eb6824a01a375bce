"""The quantized codecs end to end: a linear merge of two block-FP8, two compressed-tensors INT4 and two MXFP4
checkpoints (dimensions that are not multiples of the block, scales in another shard than their weights) gives the
bytes the same merge of the two models decoded independently (``quantmodels``' formulas) gives, whole tensors and
row chunks alike; decode then encode of an unchanged tensor gives its stored parts back byte for byte."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from quantmodels import (
    MXFP4_CONFIG,
    SCALES_FILE,
    Quantizer,
    experts,
    fp8,
    fp8_config,
    int4,
    int4_config,
    mxfp4_experts,
    quantize_model,
)
from safetensors.torch import load_file
from support import linear_config, output_tensors, write_config

from resumerge.config.locations import StateDir
from resumerge.config.merge_config import load_config_text
from resumerge.config.settings import RunSettings
from resumerge.errors import ModelInputError
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, MAIN, quantized
from resumerge.inputs.codecs.compressed import CompressedTensorsCodec
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.inputs.codecs.mxfp4 import Mxfp4Codec
from resumerge.inputs.codecs.quantized import recognise
from resumerge.inputs.quant.verdict import Checkpoint
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.engine.session import run_plan
from resumerge.merge.engine.target import Target
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.workunits import chunk_plan

# hidden 40, intermediate 56, head_dim 10: no projection is a multiple of 16 or 32 on both sides.
# Extra plain tensors a model gets (from its seed) before it is quantized.
Extra = Callable[[int], dict[str, torch.Tensor]]
SPEC = {"layers": 2, "hidden": 40, "intermediate": 56, "shard_bytes": 20_000}


def plan_for(tmp_path: Path, a: Path, b: Path) -> Plan:
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(a, b)).read_text())
    return build_plan(config, open_inputs(config).models, PlanOptions(dequantize=True), CODECS)


def merge(tmp_path: Path, a: Path, b: Path, out: str, *, max_memory: int | None = None,
          dequantize: bool = True, weights: tuple[float, float] = (0.5, 0.5)) -> dict[str, torch.Tensor]:
    """A linear merge of ``a`` and ``b`` into ``tmp_path/out``, planned and run in this process with the codecs: its
    tensors."""
    text = write_config(tmp_path / f"{out}.yml", linear_config(a, b, weights=weights)).read_text()
    config = load_config_text(text)
    settings = RunSettings(state=StateDir.resolve(tmp_path / "state"), max_memory=max_memory)
    plan = build_plan(config, open_inputs(config).models, PlanOptions(dequantize=dequantize), CODECS)
    run_plan(Prepared(plan), text, Target.open(tmp_path / out, settings), settings)
    return output_tensors(tmp_path / out)


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def pair(tmp_path: Path, make: ModelFactory, quantizer: Quantizer, config: dict[str, object],
         extra: Extra | None = None) -> list[Path]:
    models = []
    for name, seed in (("a", 1), ("b", 2)):
        directory = make(name, seed=seed, **SPEC)
        quantize_model(directory, tmp_path / f"{name}-decoded", quantizer, config,
                       extra=extra(seed) if extra else None)
        models.append(directory)
    return models


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_merge_is_the_merge_of_the_decoded_models(tmp_path: Path, make: ModelFactory, ue8m0: bool) -> None:
    a, b = pair(tmp_path, make, fp8((16, 16), ue8m0=ue8m0), fp8_config((16, 16), ue8m0=ue8m0))
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    got = merge(tmp_path, a, b, "got")
    assert "model.layers.0.mlp.down_proj.weight" in got and not any(n.endswith("_scale_inv") for n in got)
    assert_same_bytes(got, want)
    # Kept in the base's format (the default), each weight is the codec's encoding of that merged value.
    kept = merge(tmp_path, a, b, "kept", dequantize=False)
    codec = BlockFp8Codec((16, 16), "ue8m0" if ue8m0 else "float", "F8_E8M0" if ue8m0 else "F32")
    encoded = {name: t for name, t in want.items() if not name.endswith("_proj.weight")}
    for name in set(want) - set(encoded):
        parts = codec.encode(want[name], "F32")
        encoded.update({name: parts[MAIN], f"{name}_scale_inv": parts["scale"]})
    assert_same_bytes(kept, encoded)


@pytest.mark.parametrize("group", [8, None])
def test_int4_pack_quantized_merge_is_the_merge_of_the_decoded_models(tmp_path: Path, make: ModelFactory,
                                                                      group: int | None) -> None:
    a, b = pair(tmp_path, make, int4(group), int4_config(group))
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    got = merge(tmp_path, a, b, "got")
    assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in got)
    assert_same_bytes(got, want)


def test_mxfp4_expert_merge_is_the_merge_of_the_decoded_models(tmp_path: Path, make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, mxfp4_experts, MXFP4_CONFIG, extra=lambda seed: experts(2, 3, 64, 24, seed))
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    got = merge(tmp_path, a, b, "got")
    assert got["model.layers.1.mlp.experts.down_proj"].shape == (3, 64, 24)
    assert_same_bytes(got, want)


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in the model or output at ``directory``, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _round_trip(directory: Path, *, exact: bool) -> int:
    """Decode every claimed tensor of the model at ``directory`` and encode it again, checking the parts against
    what out_parts announces (names, dtypes, shapes). With ``exact`` (block FP8 and MXFP4, whose fresh scales of a
    decoded tensor are its stored ones) the parts must be the stored ones byte for byte; otherwise (compressed-tensors
    INT4, whose scale amax / 7.5 of a decoded tensor is not its stored one) the encoded tensor must decode to the
    value within half a step of its new scale. Returns how many tensors were checked."""
    config = load_config_text(write_config(directory.parent / "rt.yml",
                                           linear_config(directory, directory)).read_text())
    model = open_inputs(config).models[str(directory)].recognised(CODECS)
    stored = stored_tensors(directory)
    assert model.formats is not None
    for name, claim in model.formats.claims.items():
        parts = {part: stored[s] for part, s in claim.parts}
        value = claim.codec.decode(parts, 0)
        encoded = claim.codec.encode(value, "F32")
        announced = claim.codec.out_parts(name, "F32", tuple(value.shape))
        assert [(p.part, p.name) for p in announced] == [(p, s) for p, s in claim.parts]
        for out in announced:
            assert tuple(encoded[out.part].shape) == out.shape, (name, out.part)
            assert encoded[out.part].dtype == parts[out.part].dtype, (name, out.part)
            if exact:
                assert torch.equal(encoded[out.part].view(torch.uint8), parts[out.part].view(torch.uint8)), name
        if not exact:
            again = claim.codec.decode(encoded, 0)
            step = encoded["scale"].to(torch.float32).repeat_interleave(8, dim=1)[:, : value.shape[1]]
            assert bool(((again - value).abs() <= step / 2 + 1e-7).all()), name
    return len(model.formats.claims)


def test_decode_then_encode_gives_the_stored_parts_back(tmp_path: Path, make: ModelFactory) -> None:
    fp8_model = make("fp8", seed=3, **SPEC)
    quantize_model(fp8_model, tmp_path / "fp8-decoded", fp8((16, 16)), fp8_config((16, 16)))
    ue8m0_model = make("ue8m0", seed=6, **SPEC)
    quantize_model(ue8m0_model, tmp_path / "ue8m0-decoded", fp8((16, 16), ue8m0=True), fp8_config((16, 16), ue8m0=True))
    mx_model = make("mx", seed=5, **SPEC)
    quantize_model(mx_model, tmp_path / "mx-decoded", mxfp4_experts, MXFP4_CONFIG, extra=experts(2, 3, 64, 24, 5))
    assert {t.dtype for t in load_file(ue8m0_model / SCALES_FILE).values()} == {torch.float8_e8m0fnu}
    assert _round_trip(fp8_model, exact=True) == _round_trip(ue8m0_model, exact=True) == 2 * 7
    assert _round_trip(mx_model, exact=True) == 2


def test_compressed_tensors_encode_gives_its_stored_layout(tmp_path: Path, make: ModelFactory) -> None:
    ct_model = make("ct", seed=4, **SPEC)
    quantize_model(ct_model, tmp_path / "ct-decoded", int4(8), int4_config(8))
    assert _round_trip(ct_model, exact=False) == 2 * 7


def test_each_codec_claims_its_weights_with_companions_from_the_scales_shard(
        tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = make("fp8", seed=3, **SPEC)
    quantize_model(directory, tmp_path / "decoded", fp8((16, 16)), fp8_config((16, 16)))
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(directory, directory)).read_text())
    judged: list[object] = []

    def counted(*args: Any, **kwargs: Any) -> Checkpoint:
        judged.append(args)
        return recognise(*args, **kwargs)

    monkeypatch.setattr(quantized, "recognise", counted)
    model = open_inputs(config).models[str(directory)].recognised(CODECS)
    assert len(judged) == 1  # the table's three quantized formats share one verdict of the checkpoint
    monkeypatch.undo()
    assert model.formats is not None
    claim = model.formats.claims["model.layers.0.self_attn.k_proj.weight"]
    assert claim.codec == BlockFp8Codec((16, 16))
    assert model.formats.companions(claim.name)[0][1].file == SCALES_FILE
    assert dict(claim.parts)[MAIN] == claim.name
    assert model.formats.role_counts() == {"weight": 14, "companion": 14,
                                           "other": len(model.formats.stored) - 28}
    assert CompressedTensorsCodec.recognise(model.config, model.formats.stored) == ()
    assert Mxfp4Codec.recognise(model.config, model.formats.stored) == ()


@pytest.mark.parametrize("fmt", ["fp8", "int4", "mxfp4"])
def test_row_chunks_decode_to_the_rows_of_the_whole_tensor(tmp_path: Path, make: ModelFactory, fmt: str) -> None:
    # Chunks of 5 rows: a block-FP8 or group scale row is shared by two chunks; MXFP4's rows are experts.
    cases: dict[str, tuple[Quantizer, dict[str, object], Extra | None]] = {
        "fp8": (fp8((16, 16)), fp8_config((16, 16)), None),
        "int4": (int4(8), int4_config(8), None),
        "mxfp4": (mxfp4_experts, MXFP4_CONFIG, lambda seed: experts(1, 7, 32, 24, seed)),
    }
    quantizer, config, extra = cases[fmt]
    a, b = pair(tmp_path, make, quantizer, config, extra)
    plan = plan_for(tmp_path, a, b)
    checked = 0
    with InputSources.local(plan.model_dirs) as sources:
        for tp in plan.tensors.values():
            if tp.inputs[1].codec.plain:
                continue
            step = 5 if fmt != "mxfp4" else 2
            chunks = [chunk_plan(tp, first, min(tp.shape[0], first + step)) for first in range(0, tp.shape[0], step)]
            assert torch.equal(torch.cat([compute_tensor(plan, c, sources, NO_RESOURCES)[tp.name] for c in chunks]),
                               compute_tensor(plan, tp, sources, NO_RESOURCES)[tp.name]), tp.name
            checked += 1
    assert checked == (14 if fmt != "mxfp4" else 1)


def test_a_packed_weight_whose_weight_shape_disagrees_is_refused_naming_it(tmp_path: Path,
                                                                           make: ModelFactory) -> None:
    # Per channel, the headers bound the width to a word (33 to 40 here): weight_shape's payload decides.
    directory = make("ct", seed=4, **SPEC)
    quantize_model(directory, tmp_path / "decoded", int4(None), int4_config(None))
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(directory, directory)).read_text())
    model = open_inputs(config).models[str(directory)].recognised(CODECS)
    assert model.formats is not None
    claim = model.formats.claims["model.layers.0.self_attn.k_proj.weight"]
    stored = stored_tensors(directory)
    parts = {part: stored[s] for part, s in claim.parts}
    assert claim.codec.value_shape(tuple(parts[MAIN].shape)) == (20, 40)
    parts["shape"] = torch.tensor([20, 39])
    with pytest.raises(ModelInputError, match=r"weight_shape says \[20, 39\]"):
        claim.codec.decode(parts, 0)


def test_plans_compute_time_for_block_fp8_counts_the_decode_and_the_encode(tmp_path: Path, make: ModelFactory,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The run decodes every quantized input it merges and re-quantizes every result, so ``plan``'s speed sample
    prices both with the method. It used to time the method alone on inputs decoded beforehand: a DeepSeek-V3 pair's
    FP8 group came out at minutes for hours of work. Here each decode costs a known 50 ms more: the group's time
    holds at least that per sampled input, and the encode runs inside the timed step."""
    from resumerge.analyses.estimate.compute import measure_compute

    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    text = write_config(tmp_path / "kept.yml", linear_config(a, b)).read_text()
    config = load_config_text(text)
    plan = build_plan(config, open_inputs(config).models, PlanOptions(), CODECS)
    decode, encode = BlockFp8Codec.decode, BlockFp8Codec.encode
    encoded: list[int] = []

    def slow_decode(self: BlockFp8Codec, parts: Any, first_row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        time.sleep(0.05)
        return decode(self, parts, first_row, out)

    def counted_encode(self: BlockFp8Codec, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        encoded.append(value.numel())
        return encode(self, value, dtype)

    monkeypatch.setattr(BlockFp8Codec, "decode", slow_decode)
    monkeypatch.setattr(BlockFp8Codec, "encode", counted_encode)
    groups = [g for g in measure_compute(plan, plan.shards) if g.dtype == "float32"]
    assert groups and all(g.seconds_per_element is not None for g in groups)
    fp8_group = max(groups, key=lambda g: g.elements)
    assert fp8_group.seconds_per_element * fp8_group.sample_elements >= 2 * 0.05  # two inputs decoded, timed
    assert encoded  # the output codec's encode ran in the timed step
    # Where the run's workers fill torch's threads, each computes a tensor on one thread: the sample is timed so,
    # by that thread's CPU (the sleeps are time spent off a core, like a busy machine's), and its cost is shared
    # by the tensors computed at once.
    encoded.clear()
    (alone,) = [g for g in measure_compute(plan, plan.shards, serial=True, workers=2)
                if g.dtype == "float32" and g.elements == fp8_group.elements]
    assert (alone.threads, alone.at_once) == (1, min(2, torch.get_num_threads()))
    assert alone.seconds_per_element is not None and encoded
    assert 0 < alone.seconds_per_element * alone.sample_elements * alone.at_once < 0.05
