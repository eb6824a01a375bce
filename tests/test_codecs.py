"""The tensor codec seam: a stored format is one codec class, plugged into a run through its codec table.

A toy format defined outside the package (``toycodec``: "int8 with a per-row scale", ``X`` I8 and ``X_scale`` F32
of one entry per row, in any file of the model) is recognised, merged and checked against a hand-computed result,
with nothing of the engine changed; the plain codec keeps plain plans as they were.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from safetensors.torch import load_file
from support import linear_config, write_config
from toycodec import SCALES_FILE, TOY, WITH_TOY, RowScaledInt8, assert_same_results, quantize, twins

from resumerge.config.merge_config import load_config_text
from resumerge.config.settings import RunSettings
from resumerge.errors import ModelInputError
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, MAIN, PLAIN, Claim, CodecTable, Role
from resumerge.inputs.files import TensorSource
from resumerge.inputs.safetensors_format import TensorEntry
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.engine.session import run_plan
from resumerge.merge.engine.target import Target
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.inputrefs import format_ref
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions, compute_fingerprint, stored_layout
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.sharding import assign_shards
from resumerge.merge.plan.workunits import chunk_plan


def plan_for(tmp_path: Path, doc: dict[str, object], codecs: CodecTable) -> tuple[Plan, str]:
    text = write_config(tmp_path / "c.yml", doc).read_text()
    config = load_config_text(text)
    return build_plan(config, open_inputs(config).models, PlanOptions(), codecs), text


def test_a_new_format_is_one_codec_class_plugged_in_through_the_run_s_table(tmp_path: Path,
                                                                             make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    decoded = quantize(b)
    plan, text = plan_for(tmp_path, linear_config(a, b, weights=(0.25, 0.75)), TOY)
    matrices = [tp for tp in plan.tensors.values() if len(tp.shape) == 2]
    for tp in matrices:  # each weight one logical tensor, its scale a companion read from the scales' file
        ref = tp.inputs[1]
        assert (ref.codec, ref.dtype, ref.value_dtype) == (RowScaledInt8(), "I8", "F32")
        assert [(part, c.file, c.tensor) for part, c in ref.companions] == [("scale", SCALES_FILE,
                                                                             f"{tp.name}_scale")]
        assert tp.inputs[0].codec is PLAIN and not tp.inputs[0].companions
    assert not any(name.endswith("_scale") for name in plan.tensors)
    n = len(decoded)
    assert plan.input_roles[str(b)] == {"weight": n, "companion": n, "other": len(plan.tensors) - n}
    assert plan.input_roles[str(a)] == {"weight": 0, "companion": 0, "other": len(plan.tensors)}

    out = tmp_path / "out"
    settings = RunSettings()
    run_plan(Prepared(plan), text, Target.open(out, settings), settings)
    merged = {}
    for file in out.glob("*.safetensors"):
        merged.update(load_file(file))
    assert set(merged) == set(plan.tensors)
    originals = {}
    for file in a.glob("*.safetensors"):
        originals.update(load_file(file))
    for name, value in decoded.items():
        expected = originals[name] * 0.25 + value * 0.75
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name], expected, rtol=1e-6, atol=1e-7)


def test_row_chunks_read_each_companion_s_rows_with_theirs(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    quantize(b)
    plan, _ = plan_for(tmp_path, linear_config(a, b), TOY)
    with InputSources.local(plan.model_dirs) as sources:
        for tp in plan.tensors.values():
            if len(tp.shape) != 2 or tp.shape[0] < 3:
                continue
            chunks = [chunk_plan(tp, first, min(tp.shape[0], first + 3)) for first in range(0, tp.shape[0], 3)]
            scale = chunks[1].inputs[1].companions[0][1]
            assert (scale.first_row, scale.shape) == (3, (3,))
            assert torch.equal(torch.cat([compute_tensor(plan, c, sources, NO_RESOURCES)[tp.name] for c in chunks]),
                               compute_tensor(plan, tp, sources, NO_RESOURCES)[tp.name]), tp.name


def test_the_codec_is_part_of_the_plan_s_identity_and_plain_adds_nothing(tmp_path: Path,
                                                                        make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    quantize(b)
    plan, _ = plan_for(tmp_path, linear_config(a, b), TOY)
    plain = {name: replace(tp, inputs=tuple(replace(r, codec=PLAIN, companions=()) for r in tp.inputs))
             for name, tp in plan.tensors.items()}
    assert compute_fingerprint(replace(plan, tensors=plain)) != plan.fingerprint
    # A plain model's plan is the same plan whichever table recognised it (no format claimed a tensor).
    c, d = make("c", seed=3), make("d", seed=4)
    (tmp_path / "p").mkdir()
    assert plan_for(tmp_path / "p", linear_config(c, d), TOY)[0].fingerprint == plan_for(
        tmp_path / "p", linear_config(c, d), CodecTable())[0].fingerprint


def test_a_quant_method_is_decoded_by_the_format_that_claims_it_and_refused_where_none_does(
        tmp_path: Path, make: ModelFactory) -> None:
    # The default table refuses the toy method before any header is judged (no format claims it); the same table
    # with the toy format beside block FP8, compressed-tensors and MXFP4 decodes it, those formats never asked
    # about a method they do not claim (before, the first quantized format refused it as unknown).
    twins(make("b", seed=2), tmp_path / "codes", tmp_path / "values")
    a = make("a", seed=1)
    with pytest.raises(ModelInputError, match=r"unknown quantization method 'toy-int8' in config.json, which "
                                              r"resumerge cannot decode \(it decodes fp8, compressed-tensors, mxfp4, "
                                              r"modelopt and gguf\)"):
        plan_for(tmp_path, linear_config(a, tmp_path / "codes"), CODECS)
    assert WITH_TOY.methods == ("fp8", "compressed-tensors", "mxfp4", "modelopt", "gguf", "toy-int8")
    with pytest.raises(ModelInputError, match=r"\(it decodes toy-int8\)"):
        TOY.recognise({"quantization_config": {"quant_method": "fp8"}}, _stored(w="F8_E4M3"))
    codes, _ = plan_for(tmp_path, linear_config(a, tmp_path / "codes"), WITH_TOY)
    values, _ = plan_for(tmp_path, linear_config(a, tmp_path / "values"), WITH_TOY)
    assert {ref.codec for tp in codes.tensors.values() for ref in tp.inputs} == {PLAIN, RowScaledInt8()}
    assert_same_results(codes, values)


def test_the_api_takes_a_codec_table(tmp_path: Path, make: ModelFactory) -> None:
    # The front door hands a notebook's table to the planner and the run: the toy format is decoded through it,
    # and refused by the default table.
    from resumerge import api

    a, b = make("a", seed=1), make("b", seed=2)
    twins(b, tmp_path / "codes", tmp_path / "values")
    config = write_config(tmp_path / "c.yml", linear_config(a, tmp_path / "codes"))
    with pytest.raises(ModelInputError, match="unknown quantization method 'toy-int8'"):
        api.plan_merge(config)
    plan = api.plan_merge(config, codecs=WITH_TOY)
    assert RowScaledInt8() in {ref.codec for tp in plan.tensors.values() for ref in tp.inputs}
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s"), codecs=WITH_TOY)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == plan.tensors.keys()


def test_a_format_s_claims_are_checked_against_the_headers(tmp_path: Path, make: ModelFactory) -> None:
    b = make("b", seed=2)
    quantize(b)
    (b / SCALES_FILE).unlink()
    index_path = b / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != SCALES_FILE}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelInputError, match="has no scale"):
        plan_for(tmp_path, linear_config(b, b), TOY)


def test_stored_formats_give_every_stored_tensor_a_role(tmp_path: Path, make: ModelFactory) -> None:
    b = make("b", seed=2)
    quantize(b)
    config = load_config_text(write_config(tmp_path / "c.yml", linear_config(b, b)).read_text())
    model = open_inputs(config).models[str(b)].recognised(TOY)
    assert model.formats is not None
    roles = model.formats.roles
    for name, claim in model.formats.claims.items():
        assert roles[claim.main] is Role.WEIGHT and roles[f"{name}_scale"] is Role.COMPANION
        assert f"{name}_scale" not in model.tensors and model.tensors[name].entry.dtype == "I8"
    assert {roles[n] for n in model.tensors if n not in model.formats.claims} == {Role.OTHER}


def _stored(**dtypes: str) -> dict[str, TensorSource]:
    return {name: TensorSource("m.safetensors", TensorEntry(name, dtype, (2, 2), 0, 0))
            for name, dtype in dtypes.items()}


def test_a_fast_built_ref_is_the_ref_its_dataclass_makes() -> None:
    # inputrefs builds refs without InputRef.__init__, leaving defaulted fields to the class: sound only while no
    # field has a default_factory and nothing runs after __init__. Pickles are not byte-equal (the fast one's
    # leaves the defaults out); what matters is that they load back as equal refs.
    assert all(f.default_factory is MISSING for f in fields(InputRef)) and not hasattr(InputRef, "__post_init__")
    stored = {"w": TensorSource("a.safetensors", TensorEntry("w", "I8", (2, 3), 8, 14)),
              "w_scale": TensorSource("b.safetensors", TensorEntry("w_scale", "F32", (2,), 0, 8)),
              "norm": TensorSource("a.safetensors", TensorEntry("norm", "F32", (3,), 14, 26))}
    formats = TOY.recognise({"quantization_config": {"quant_method": RowScaledInt8.name}}, stored)
    scale = InputRef("m", "b.safetensors", "w_scale", "F32", (2,), 0, 8)
    made = {"norm": InputRef("m", "a.safetensors", "norm", "F32", (3,), 14, 26),
            "w": InputRef("m", "a.safetensors", "w", "I8", (2, 3), 8, 14, codec=RowScaledInt8(),
                          companions=(("scale", scale),))}
    for name, want in made.items():
        got = format_ref("m", formats, name)
        again = pickle.loads(pickle.dumps(got))
        assert got == want == again and hash(got) == hash(want) == hash(again), name
        assert pickle.loads(pickle.dumps(want)) == got, name


def test_a_stored_tensor_belongs_to_one_logical_tensor() -> None:
    config = {"quantization_config": {"quant_method": RowScaledInt8.name}}
    tensors = _stored(w="I8", w_scale="F32", norm="F32")
    formats = TOY.recognise(config, tensors)
    assert formats.role_counts() == {"weight": 1, "companion": 1, "other": 1}
    assert set(formats.logical()) == {"w", "norm"} and formats.codec("norm") is PLAIN

    @dataclass(frozen=True)
    class ScaleOwner(RowScaledInt8):
        """Claims ``w_scale`` as a tensor of its own, which the toy format already made a companion."""

        @classmethod
        def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
            return (Claim("w_scale", ((MAIN, "w_scale"),), cls()),)

    @dataclass(frozen=True)
    class Renamer(RowScaledInt8):
        """Names ``w``'s logical tensor ``norm``, a tensor the model stores plainly."""

        @classmethod
        def recognise(cls, config: Mapping[str, Any], tensors: Mapping[str, TensorSource]) -> tuple[Claim, ...]:
            return (Claim("norm", ((MAIN, "w"), ("scale", "w_scale")), cls()),)

    with pytest.raises(ModelInputError, match="w_scale belongs to both w and w_scale"):
        CodecTable((RowScaledInt8, ScaleOwner)).recognise(config, tensors)
    with pytest.raises(ModelInputError, match="norm is a stored tensor of its own"):
        CodecTable((Renamer,)).recognise(config, tensors)


def test_an_output_codec_s_parts_are_laid_out_in_the_shard_under_their_names(tmp_path: Path,
                                                                             make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    plan, _ = plan_for(tmp_path, linear_config(a, b), CodecTable())
    toy = {n: replace(tp, out_codec=RowScaledInt8()) if len(tp.shape) == 2 else tp for n, tp in plan.tensors.items()}
    shards, placed = assign_shards(toy, 10**9)
    layout = stored_layout(placed, shards[0].tensors)
    stored = {p.name: (p.dtype, p.shape) for p in layout.order}
    matrices = [n for n, tp in toy.items() if len(tp.shape) == 2]
    assert stored == {**{n: (tp.out_dtype, tp.shape) for n, tp in toy.items()},
                      **{n: ("I8", toy[n].shape) for n in matrices},
                      **{f"{n}_scale": ("F32", toy[n].shape[:1]) for n in matrices}}
    assert sorted(shards[0].tensors) == sorted(toy) and shards[0].file_size == layout.file_size
    # Each tensor is listed where its first part lies: its scale's place (F32 data comes before I8).
    first = [p.name.removesuffix("_scale") for p in layout.order]
    assert list(shards[0].tensors) == list(dict.fromkeys(first))
