"""NVFP4 outputs whose fused projections share one tensor-wide scale, as vLLM and TensorRT-LLM load them: the plan
groups q/k/v and gate/up (and fingerprints the groups), every member of a written group stores the same
``weight_global_scale``, compressed-tensors' own decompress of each member gives resumerge's decoded value, an
unwritten merge computes the same bytes as the written one, and a merge killed between the members of a group
(one member's shard committed, the others' not) resumes to the bytes of an uninterrupted run. The bytes of each
member against compressed-tensors' and ModelOpt's own quantization of the merged group: tests/test_quant_nvfp4.py."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quantmodels import NVFP4_CT_CONFIG, ct_nvfp4_quantizer, fused_group, quantize_model
from safetensors.torch import load_file
from support import cli, digests, linear_config, peak_rss_run, write_config

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, Nvfp4Codec
from resumerge.inputs.source import InputSources
from resumerge.merge.engine.unwritten import MergedFiles
from resumerge.merge.engine.unwritten.merged import stored_places
from resumerge.merge.plan.fusedscales import share_scales
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions, TensorPlan, compute_fingerprint
from resumerge.merge.plan.planner import build_plan

pytest.importorskip("compressed_tensors")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, shard_bytes=20_000)
# Small shards: layer 1's k_proj lands in the fifth of six shards, its q_proj and v_proj in the sixth.
SHARD = "3000"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Two compressed-tensors NVFP4 models (each weight with its own global scale, as the library writes one
    alone) and a linear merge config over them."""
    root = tmp_path_factory.mktemp("fused")
    found = []
    for name, seed in (("a", 1), ("b", 2)):
        directory = make_model(root / name, SPEC, seed=seed)
        quantize_model(directory, root / f"{name}-decoded", ct_nvfp4_quantizer, NVFP4_CT_CONFIG)
        found.append(directory)
    config = write_config(root / "merge.yml", linear_config(found[0], found[1]))
    return found[0], found[1], config


def _plan(config: Path, **options: object) -> Plan:
    parsed = load_config_text(config.read_text())
    return build_plan(parsed, open_inputs(parsed).models, PlanOptions(**options), CODECS)  # type: ignore[arg-type]


def _group(tp: TensorPlan) -> tuple[str, ...]:
    assert isinstance(tp.out_codec, Nvfp4Codec)
    return tp.out_codec.group


def _shares_scale(stored: dict[str, torch.Tensor], attention: str) -> bool:
    """Whether q/k/v of ``attention`` store one global scale."""
    scales = [stored[f"{attention}.{p}_proj.weight_global_scale"] for p in "qkv"]
    return all(torch.equal(s, scales[0]) for s in scales)


def test_the_plan_groups_fused_projections(models: tuple[Path, Path, Path]) -> None:
    plan = _plan(models[2])
    weights = {n: tp for n, tp in plan.tensors.items() if isinstance(tp.out_codec, Nvfp4Codec)}
    assert len(weights) == 2 * 7
    for name, tp in weights.items():
        wanted = fused_group(name)
        assert _group(tp) == (wanted if len(wanted) > 1 else ()), name
    assert sum("share one NVFP4 tensor-wide scale" in note for note in plan.notes) == 1
    # The groups are the plan's decision: a plan without them is another plan (a resume of it is refused).
    alone = {n: replace(tp, out_codec=replace(tp.out_codec, group=())) if n in weights else tp
             for n, tp in plan.tensors.items()}
    assert compute_fingerprint(replace(plan, tensors=alone)) != plan.fingerprint


def test_a_group_copied_whole_from_one_model_keeps_its_scales(models: tuple[Path, Path, Path],
                                                               tmp_path: Path) -> None:
    config = write_config(tmp_path / "one-hot.yml", linear_config(models[0], models[1], weights=(1.0, 0.0)))
    plan = _plan(config)
    projections = [tp for tp in plan.tensors.values() if isinstance(tp.out_codec, Nvfp4Codec)]
    assert projections and all(tp.copy_of == 0 and _group(tp) == () for tp in projections)
    # k_proj taken whole from the second model, q_proj and v_proj from the first: two checkpoints' scales, which no
    # copy can share; the group is encoded again with one.
    mixed = write_config(tmp_path / "mixed.yml", linear_config(
        models[0], models[1], weights=([{"filter": "k_proj", "value": 0.0}, {"value": 1.0}],
                                       [{"filter": "k_proj", "value": 1.0}, {"value": 0.0}])))
    plan = _plan(mixed)
    attention = {p: plan.tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkvo"}
    assert attention["o"].copy_of == 0 and _group(attention["o"]) == ()
    assert all(attention[p].copy_of is None and len(_group(attention[p])) == 3 for p in "qkv")
    gate = plan.tensors["model.layers.0.mlp.gate_proj.weight"]
    assert gate.copy_of == 0 and _group(gate) == ()


def test_members_share_one_global_scale_and_decode_as_the_library(models: tuple[Path, Path, Path],
                                                                  tmp_path: Path) -> None:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from quantmodels import NVFP4_CT_ARGS

    out = tmp_path / "out"
    assert main(["run", str(models[2]), str(out), "--state-dir", str(tmp_path / "state"), "--quiet"]) == 0
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        stored.update(load_file(shard))
    args = QuantizationArgs(**{k: v for k, v in NVFP4_CT_ARGS.items() if k != "observer"},
                            scale_dtype=torch.float8_e4m3fn)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    codec = Nvfp4Codec("compressed-tensors", (1,))
    assert "share one NVFP4 tensor-wide scale" in (out / "README.md").read_text()  # the card says so
    groups = {fused_group(n.removesuffix("_packed")) for n in stored if n.endswith(".weight_packed")}
    assert sum(len(g) > 1 for g in groups) == 4
    for group in groups:
        scales = [stored[m.removesuffix("weight") + "weight_global_scale"] for m in group]
        assert all(torch.equal(s, scales[0]) for s in scales), group
        for member in group:
            module = member.removesuffix(".weight")
            parts = {p: stored[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            library = NVFP4PackedCompressor.decompress(dict(parts), scheme)["weight"]
            ours = codec.decode({"main": parts["weight_packed"], "scale": parts["weight_scale"],
                                 "weight_global_scale": parts["weight_global_scale"]}, 0)
            assert torch.equal(ours.to(library.dtype), library), member


def test_an_unwritten_merge_measures_each_group_as_the_run_does(models: tuple[Path, Path, Path],
                                                                tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["run", str(models[2]), str(out), "--state-dir", str(tmp_path / "state"), "--quiet"]) == 0
    plan = _plan(models[2])
    written: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        written.update(load_file(shard))
    name = "model.layers.1.self_attn.k_proj.weight"  # its group's other members lie in another shard
    parts = {p.name for p in plan.tensors[name].stored_parts()}
    with InputSources.local(plan.model_dirs) as sources:
        merged = MergedFiles(plan, sources)
        for (file, start), (_, part, end) in stored_places(plan).items():
            if part in parts:
                got = merged.read_range(file, start, end)
                assert torch.equal(got, written[part].reshape(-1).view(torch.uint8)), part
                parts.discard(part)
        merged.close()
    assert not parts
    assert _shares_scale(written, "model.layers.1.self_attn")


@pytest.mark.parametrize("point", ["after_ledger_commit", "mid_shard_write"])
def test_a_kill_between_group_members_resumes_identically(models: tuple[Path, Path, Path], tmp_path: Path,
                                                          point: str) -> None:
    reference = tmp_path / "reference"
    assert main(["run", str(models[2]), str(reference), "--state-dir", str(tmp_path / "ref-state"),
                 "--out-shard-size", SHARD, "--quiet"]) == 0
    plan = _plan(models[2], out_shard_size=3000)
    k_shard = plan.tensors["model.layers.1.self_attn.k_proj.weight"].shard
    q_shard = plan.tensors["model.layers.1.self_attn.q_proj.weight"].shard
    assert k_shard != q_shard  # the group straddles two shards
    order = [s.name for s in plan.shards]
    # Killed once k_proj's shard is committed (the ledger row of the fifth shard), or while q_proj's is written.
    nth = order.index(k_shard) + 1 if point == "after_ledger_commit" else order.index(q_shard) + 1
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", models[2], out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env={"RESUMERGE_KILL_AT": f"{point}:{nth}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / k_shard).is_file() and not (out / q_shard).is_file()
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == digests(reference)
    resumed: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        resumed.update(load_file(shard))
    assert _shares_scale(resumed, "model.layers.1.self_attn")
    shutil.rmtree(state)


def _weight(name: str, codec: Nvfp4Codec, *, model: str = "a", copy_of: int | None = None) -> TensorPlan:
    ref = InputRef(model, "m.safetensors", name, "U8", (16, 8), 0, 128, codec=codec)
    return TensorPlan(name, "", "linear", (ref,), 0, ((),), (), (16, 16), None, "F32", 0, out_codec=codec,
                      copy_of=copy_of)


@pytest.mark.parametrize(("children", "grouped"), [
    (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj")),
    (("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), ("q_a_proj", "kv_a_proj_with_mqa")),
    (("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), ("q_proj", "kv_a_proj_with_mqa")),
    (("gate_proj", "up_proj", "down_proj"), ("gate_proj", "up_proj")),
    (("w1", "w2", "w3"), ("w1", "w3")),
    (("q_proj", "k_proj", "o_proj"), ()),  # v_proj stored plainly: no engine fuses a partial set
    (("qkv_proj", "o_proj"), ()),  # fused already: one tensor
])
def test_each_family_s_fused_set_is_one_group(children: tuple[str, ...], grouped: tuple[str, ...]) -> None:
    codec = Nvfp4Codec("compressed-tensors", (1,))
    # Two MoE experts of one layer: each expert's own group, never one across experts.
    tensors = {n: _weight(n, codec) for e in (0, 1) for c in children
               for n in [f"model.layers.3.mlp.experts.{e}.{c}.weight"]}
    planned = share_scales(tensors)
    for name, tp in planned.items():
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        assert _group(tp) == (tuple(f"{parent}.{c}.weight" for c in grouped) if child in grouped else ()), name


def test_members_of_other_formats_or_copied_from_one_model_are_not_grouped() -> None:
    ct, modelopt = Nvfp4Codec("compressed-tensors", (1,)), Nvfp4Codec("modelopt", ())
    names = [f"m.{c}_proj.weight" for c in ("gate", "up")]
    mixed = {names[0]: _weight(names[0], ct), names[1]: _weight(names[1], modelopt)}
    assert all(_group(tp) == () for tp in share_scales(mixed).values())
    copied = {n: _weight(n, ct, copy_of=0) for n in names}
    assert all(_group(tp) == () and tp.copy_of == 0 for tp in share_scales(copied).values())
    two = {names[0]: _weight(names[0], ct, copy_of=0), names[1]: _weight(names[1], ct, model="b", copy_of=0)}
    assert all(_group(tp) == tuple(names) and tp.copy_of is None for tp in share_scales(two).values())


def test_a_run_at_the_smallest_budget_measures_its_groups_within_it(models: tuple[Path, Path, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Each group is measured member by member, each admitted as its own unit: a run at the smallest budget
    ``plan`` names writes the bytes of an unbounded one and stays within it."""
    reference = tmp_path / "reference"
    assert main(["run", str(models[2]), str(reference), "--state-dir", str(tmp_path / "ref-state"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["plan", str(models[2]), str(tmp_path / "out"), "--json", "--probe-size", "0"]) == 0
    smallest = int(json.loads(capsys.readouterr().out)["memory"]["smallest_budget"])
    out = tmp_path / "out"
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", str(models[2]), str(out),
                                    "--state-dir", str(tmp_path / "state"), "--quiet", "--max-memory", str(smallest)])
    assert code == 0, err
    assert peak <= 1.05 * smallest, (peak, smallest)
    assert digests(out) == digests(reference)
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        stored.update(load_file(shard))
    assert _shares_scale(stored, "model.layers.0.self_attn") and _shares_scale(stored, "model.layers.1.self_attn")


def test_plan_counts_the_group_scale_pass(models: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """``plan`` counts the pass that measures each fused group before its first member is encoded: every member's
    inputs read once more, its elements computed once more (in its method's compute group), and its merge admitted
    as a unit of its own in the RAM's units; a note says so. The same plan without groups counts none of it."""
    from resumerge import api
    from resumerge.analyses.estimate.memory import pending_units
    from resumerge.inputs.safetensors_format import numel

    found = api.estimate(models[2], tmp_path / "out", api.Settings(resources=api.Resources(max_memory="2GB")),
                         probe_size=0)
    plan = found.plan
    members = [tp for tp in plan.tensors.values() if isinstance(tp.out_codec, Nvfp4Codec) and tp.out_codec.group]
    assert len(members) == 2 * 5  # per layer q/k/v and gate/up

    def read(tensors: list[TensorPlan]) -> int:
        return sum(i.end - i.start for tp in tensors for i in tp.inputs)

    assert found.time.read_bytes == read(list(plan.tensors.values())) + read(members)
    assert sum(g.elements for g in found.time.compute) == sum(
        numel(tp.shape) for tp in [*plan.tensors.values(), *members] if tp.inputs)
    assert any("NVFP4 group scales: 10 tensor(s)" in note for note in found.time.notes)
    alone = replace(plan, tensors={n: replace(tp, out_codec=replace(tp.out_codec, group=()))
                                   if isinstance(tp.out_codec, Nvfp4Codec) else tp for n, tp in plan.tensors.items()})
    budget = 1 << 30
    assert len(pending_units(plan, plan.shards, budget)) >= len(pending_units(alone, plan.shards, budget)) + 10
