"""A quantized format plugged in from outside the package, in both directions: ``toyquant`` (its codec file) and the
one line that lists it in a table are all it takes for a merge of two models in the format to be recognised,
decoded, merged, written back in the format (its ``quantization_config`` kept) and judged by ``verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from safetensors.torch import load_file
from support import linear_config, write_config
from toyquant import WITH_TOY_Q8, ToyQ8, quantize

from resumerge import api
from resumerge.config.locations import StateDir
from resumerge.errors import ModelInputError
from resumerge.inputs.codecs import MAIN
from resumerge.inputs.codecs.quantized import SCALE
from resumerge.merge.store.integrity import verify_output


def test_a_format_from_outside_reads_writes_and_verifies_through_its_codec_and_one_table_line(
        tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    values = {"a": quantize(a), "b": quantize(b)}
    config = write_config(tmp_path / "c.yml", linear_config(a, b, weights=(0.25, 0.75)))
    with pytest.raises(ModelInputError, match="unknown quantization method 'toy-q8'"):
        api.plan_merge(config)  # the default table does not list it
    plan = api.plan_merge(config, codecs=WITH_TOY_Q8)
    matrices = {n for n, tp in plan.tensors.items() if len(tp.shape) == 2}
    assert matrices == values["a"].keys() and matrices
    assert all(isinstance(plan.tensors[n].out_codec, ToyQ8) for n in matrices)  # kept in its format
    assert plan.input_roles[str(a)] == {"weight": len(matrices), "companion": len(matrices),
                                        "other": len(plan.tensors) - len(matrices)}

    out, state = tmp_path / "out", tmp_path / "state"
    api.run(config, out, settings=api.Settings(state_dir=state), codecs=WITH_TOY_Q8)
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {"quant_method": "toy-q8"}
    for name in matrices:  # encoded by the format's encoder, decoded by its decoder: the merge within a code step
        codes, scale = written[name], written[f"{name}_qscale"]
        assert codes.dtype == torch.int8 and scale.shape == (codes.shape[0],)
        value = ToyQ8().decode({MAIN: codes, SCALE: scale}, 0)
        expected = values["a"][name] * 0.25 + values["b"][name] * 0.75
        assert ((value - expected).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all(), name

    report = verify_output(out, StateDir.resolve(state), WITH_TOY_Q8)
    assert report.ok and report.formats is not None
    assert report.formats["found"] == {"format": "toy-q8", "roles": report.formats["planned"]["roles"]}
    assert report.formats["planned"]["format"] == "toy-q8"
    unjudged = verify_output(out, StateDir.resolve(state)).formats  # a table without it does not judge it
    assert unjudged is not None and unjudged["found"] is None
