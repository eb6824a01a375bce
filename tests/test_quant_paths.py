"""The quantized paths the first end-to-end tests left out: compressed-tensors checkpoints that mix asymmetric INT4
(pack-quantized), naive INT8 and float-quantized FP8 in its tensor, channel and block strategies, compressed and
decompressed by the compressed-tensors library itself; fused 3-D block-FP8 experts; and static activation scales,
carried from the base into an output kept in its format. Each merge gives the bytes of the same merge of the models
decoded independently."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from mergekit_oracle import Mergekit
from quantmodels import CtGroup, ct_config, ct_library, experts, fp8, fp8_config, fused_fp8
from safetensors.torch import load_file, save_file
from support import linear_config, write_config
from test_quant_codecs import assert_same_bytes, merge, pair, stored_tensors

from resumerge import api
from resumerge.config.locations import run_dir
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, MAIN
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.compute import compute_tensor
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.workunits import chunk_plan
from resumerge.merge.store.manifest import MANIFEST_NAME, decode_manifest

pytest.importorskip("compressed_tensors")

MIXED: list[CtGroup] = [
    (r".*mlp\.(gate|up)_proj", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 8,
                                "symmetric": False}, "pack-quantized"),
    (r".*mlp\.down_proj", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
     "naive-quantized"),
    (r".*q_proj", {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}, "float-quantized"),
    (r".*(k|v)_proj", {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "float-quantized"),
    (r".*o_proj", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 8],
                   "symmetric": True}, "float-quantized"),
]


def test_mixed_compressed_tensors_merge_is_the_merge_of_the_library_decoded_models(tmp_path: Path,
                                                                                 make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, ct_library(MIXED), ct_config(MIXED))
    stored = stored_tensors(a)
    # every kind of weight is in the checkpoint, asymmetric INT4 with its packed zero points
    assert {"model.layers.0.mlp.up_proj.weight_zero_point", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.self_attn.o_proj.weight_scale"} <= set(stored)
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    assert_same_bytes(merge(tmp_path, a, b, "got"), want)


def test_fused_fp8_experts_merge_per_expert_and_keep_their_format(tmp_path: Path, make: ModelFactory) -> None:
    # [experts, rows, cols] F8_E4M3 with [experts, grid rows, grid cols] scales; 40 x 24 is no multiple of 16.
    a, b = pair(tmp_path, make, fused_fp8((16, 16)), fp8_config((16, 16)),
                extra=lambda seed: experts(2, 3, 40, 24, seed))
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    assert_same_bytes(merge(tmp_path, a, b, "got"), want)
    kept = merge(tmp_path, a, b, "kept", dequantize=False)
    codec = BlockFp8Codec((16, 16), fused=True)
    encoded = {name: t for name, t in want.items() if t.dim() != 3}
    for name in set(want) - set(encoded):
        parts = codec.encode(want[name], "F32")
        encoded.update({name: parts[MAIN], f"{name}_scale_inv": parts["scale"]})
    assert kept["model.layers.1.mlp.experts.down_proj_scale_inv"].shape == (3, 3, 2)
    assert_same_bytes(kept, encoded)


STATIC: list[CtGroup] = [(r".*_proj", {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                          "float-quantized")]


def test_static_activation_scales_are_the_bases_in_an_output_kept_in_its_format(tmp_path: Path,
                                                                               make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, ct_library(STATIC, static=True), ct_config(STATIC, static=True))
    stored_a, stored_b = stored_tensors(a), stored_tensors(b)
    kept = merge(tmp_path, a, b, "kept", dequantize=False)
    scales = [n for n in kept if n.endswith(".input_scale")]
    assert len(scales) == 14  # calibrated on activations, not weights: the base's (the first model's), unchanged
    assert all(torch.equal(kept[n], stored_a[n]) and not torch.equal(kept[n], stored_b[n]) for n in scales)
    # a module taken whole from the second model is its stored bytes, its own activation scale included
    one_hot = merge(tmp_path, a, b, "one-hot", dequantize=False, weights=(0.0, 1.0))
    assert_same_bytes(one_hot, stored_b)
    plain = merge(tmp_path, a, b, "plain")
    assert not any(n.endswith("_scale") for n in plain)
    assert "14 static activation scales (input_scale) are copied" in (tmp_path / "kept" / "README.md").read_text()
    # In row chunks (a tight budget's units), the carried scale comes with the first rows, and nothing after.
    text = write_config(tmp_path / "c.yml", linear_config(a, b, weights=(0.5, 0.5))).read_text()
    config = load_config_text(text)
    plan = build_plan(config, open_inputs(config).models, PlanOptions(), CODECS)
    tp = plan.tensors["model.layers.0.mlp.down_proj.weight"]
    assert [part for part, _ in tp.carried] == ["input_scale"]
    with InputSources.local(plan.model_dirs) as sources:
        whole = compute_tensor(plan, tp, sources, NO_RESOURCES)
        first, rest = (compute_tensor(plan, chunk_plan(tp, *rows), sources, NO_RESOURCES)
                       for rows in ((0, 16), (16, tp.shape[0])))
    scale = "model.layers.0.mlp.down_proj.input_scale"
    assert torch.equal(first[scale], whole[scale]) and rest[scale].numel() == 0
    assert torch.equal(whole[scale], stored_a[scale])
    assert torch.equal(torch.cat([first[tp.name], rest[tp.name]]).view(torch.uint8), whole[tp.name].view(torch.uint8))


def test_mergekit_averages_fp8_codes_where_resumerge_merges_the_decoded_values(tmp_path: Path, make: ModelFactory,
                                                                              mergekit: Mergekit) -> None:
    # What the plan's note (log, status, card) says mergekit 0.1.5 does on the same block-FP8 pair.
    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    # In float32 (without a dtype mergekit stops on torch's FP8 promotion; with one it casts the codes first).
    config = write_config(tmp_path / "theirs.yml", {**linear_config(a, b, weights=(0.5, 0.5)), "dtype": "float32"})
    done = mergekit.run(config, tmp_path / "theirs", "--quiet")
    assert done.returncode == 0, done.stderr
    theirs = stored_tensors(tmp_path / "theirs")
    want = merge(tmp_path, tmp_path / "a-decoded", tmp_path / "b-decoded", "want")
    ours = merge(tmp_path, a, b, "ours")
    assert_same_bytes(ours, want)
    stored_a, stored_b = stored_tensors(a), stored_tensors(b)
    for name, t in want.items():
        if name.endswith("_proj.weight"):  # the codes' average, no scale applied: |w| in the hundreds
            codes = stored_a[name].to(torch.float32) * 0.5 + stored_b[name].to(torch.float32) * 0.5
            assert torch.equal(theirs[name], codes) and not torch.equal(theirs[name], t), name
    assert not any(n.endswith("_scale_inv") for n in theirs)  # the scales dropped...
    assert "quantization_config" in json.loads((tmp_path / "theirs" / "config.json").read_text())  # ...not the claim
    card = (tmp_path / "ours" / "README.md").read_text()  # the card says so (as the log and status do)
    assert "mergekit 0.1.5 merges their FP8 codes as numbers, without their scales" in card


def test_status_and_verify_count_roles_and_verify_names_a_weight_without_its_companion(tmp_path: Path,
                                                                                       make: ModelFactory) -> None:
    a, b = pair(tmp_path, make, fp8((16, 16)), fp8_config((16, 16)))
    out, state = tmp_path / "kept", tmp_path / "state"
    merge(tmp_path, a, b, "kept", dequantize=False)
    planned = api.status(out, settings=api.Settings(state_dir=state)).to_json()["formats"]
    roles = {"weight": 14, "companion": 14, "other": len(stored_tensors(out)) - 28}
    assert planned["output"] == {"format": "fp8-block", "roles": roles}
    assert planned["inputs"][str(a)] == {"format": "fp8-block", "roles": roles}
    report = api.verify(out, settings=api.Settings(state_dir=state))
    assert report.ok and report.formats == {"found": {"format": "fp8", "roles": roles}, "planned": planned["output"]}
    # A shard rewritten without one scale (its bytes change too): the one line names the weight left without it.
    lost = "model.layers.1.mlp.up_proj.weight"
    (shard,) = [f for f in out.glob("*.safetensors") if f"{lost}_scale_inv" in load_file(f)]
    tensors = load_file(shard)
    del tensors[f"{lost}_scale_inv"]
    save_file(tensors, shard)
    damaged = {d.name: d.problem for d in api.verify(out, settings=api.Settings(state_dir=state)).damaged}
    # A file that fails its checksum is reported, never parsed (issue 60: verify crashed on a damaged config.json).
    assert list(damaged) == [shard.name]
    # Committed as it is now (as if the run had written it so): its checksum holds, and the loader's look names
    # the weight left without its scale.
    _recommit(out, state, shard.name)
    damaged = {d.name: d.problem for d in api.verify(out, settings=api.Settings(state_dir=state)).damaged}
    assert shard.name not in damaged
    assert "an fp8 weight without its scale" in damaged[lost] and f"{lost}_scale_inv" in damaged[lost]


def _recommit(out: Path, state: Path, name: str) -> None:
    """Record the bytes of OUT's ``name`` as committed, in the ledger and the manifest alike."""
    data = (out / name).read_bytes()
    size, sha = len(data), hashlib.sha256(data).hexdigest()
    with sqlite3.connect(run_dir(out, state) / "ledger.db") as db:
        db.execute("UPDATE files SET bytes = ?, sha256 = ? WHERE name = ?", (size, sha, name))
    manifest = decode_manifest((out / MANIFEST_NAME).read_bytes())
    committed = {**manifest.committed, name: {"bytes": size, "sha256": sha}}
    (out / MANIFEST_NAME).write_bytes(replace(manifest, committed=committed).to_bytes())
