"""``resumerge measure`` then a ``regmean`` merge, end to end through the CLI on tiny Llama models: the merged linears
are the closed form on the measured Grams, everything else the mean; every refusal is one line, exit 2, before a
weight is written; a measurement killed by a real SIGKILL resumes at the layer reached and ends byte-identical. The
commands that are not killed run through the CLI's ``main`` in this process (``cli_here``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support import cli, cli_here, digests, output_tensors, write_config

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import UsageError
from resumerge.inputs.grams import MANIFEST, read_measurement, sha256_of
from resumerge.merge.methods.regmean import regmean_solve

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = "The capital of France is Paris.\ndef square(x): return x * x\n12 times 7 is 84.\n"


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Llama models, their regmean config and their measured Grams (through the CLI)."""
    root = tmp_path_factory.mktemp("regmean")
    a, b = make_model(root / "a", SPEC, seed=1), make_model(root / "b", SPEC, seed=2)
    (root / "texts.txt").write_text(TEXTS)
    grams = root / "grams"
    config = write_config(root / "rm.yml", {
        "merge_method": "regmean", "models": [{"model": str(a)}, {"model": str(b)}],
        "parameters": {"grams": str(grams), "reduce_non_diagonal_ratio": 0.7}, "dtype": "float32"})
    # a fresh process, as the killed and resumed measurement compared with it (bytes of matrix products)
    done = cli("measure", config, grams, "--texts", root / "texts.txt")
    assert done.returncode == 0, done.stderr
    assert "measured: 2 model(s)" in done.stdout
    return {"root": root, "a": a, "b": b, "grams": grams, "config": config, "texts": root / "texts.txt"}


def _weight(model: Path, name: str) -> torch.Tensor:
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                return f.get_tensor(name)
    raise KeyError(name)


def _copy(measured: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the Gram folder and a config naming it (the refusal tests damage the copy)."""
    grams = tmp_path / "grams"
    shutil.copytree(measured["grams"], grams)
    doc = {"merge_method": "regmean", "models": [{"model": str(measured["a"])}, {"model": str(measured["b"])}],
           "parameters": {"grams": str(grams)}}
    return grams, write_config(tmp_path / "rm.yml", doc)


def _refused(config: Path, out: Path, *words: str) -> None:
    done = cli_here("run", config, out, "--state-dir", out.parent / "state")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(w in done.stderr for w in words), done.stderr
    assert not out.exists()


def test_the_measurement_records_every_linear_and_each_files_sha256(measured: dict[str, Path]) -> None:
    from resumerge.analyses.measure import status as measurestatus
    from resumerge.inputs import grams

    assert (measurestatus.MANIFEST, measurestatus.LAYER_PREFIX) == (grams.MANIFEST, grams.LAYER_PREFIX)
    found = read_measurement(measured["grams"])
    assert [m.path for m in found.models] == [str(measured["a"]), str(measured["b"])]
    for model in found.models:
        assert len(model.grams) == 7 * SPEC.layers  # q, k, v, o, gate, up, down
        assert model.grams["model.layers.1.self_attn.v_proj"].tensor == "model.layers.1.self_attn.q_proj"
        assert model.grams["model.layers.1.mlp.up_proj"].tensor == "model.layers.1.mlp.gate_proj"
        assert model.grams["model.layers.1.mlp.down_proj"].size == SPEC.intermediate
        for file, digest in model.sha256.items():
            assert sha256_of(measured["grams"] / file) == digest
            gram = load_file(str(measured["grams"] / file))["model.layers.0.self_attn.q_proj"
                                                              if "00000" in file else "model.layers.1.self_attn.q_proj"]
            assert torch.equal(gram, gram.T) and bool((torch.linalg.eigvalsh(gram.double()) > -1e-6).all())
    assert not (measured["grams"] / ".journal").exists()
    again = cli_here("measure", measured["config"], measured["grams"], "--texts", measured["texts"])
    assert again.returncode == 0 and "already measured" in again.stdout, again.stderr


def test_regmean_merges_the_linears_by_the_closed_form_and_averages_the_rest(measured: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = cli_here("run", measured["config"], out, "--state-dir", tmp_path / "state", "-q")
    assert done.returncode == 0, done.stderr
    merged = output_tensors(out)
    found = read_measurement(measured["grams"])
    a, b = measured["a"], measured["b"]
    for name, tensor in merged.items():
        module = name.removesuffix(".weight")
        ws = [_weight(a, name), _weight(b, name)]
        if module in found.models[0].grams:
            refs = [m.grams[module] for m in found.models]
            grams = [load_file(str(measured["grams"] / r.file))[r.tensor] for r in refs]
            expected, used_pinv = regmean_solve(ws, grams, 0.7)
            assert not used_pinv
            torch.testing.assert_close(tensor.double(), expected, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(tensor, (ws[0] + ws[1]) / 2), name
        else:
            torch.testing.assert_close(tensor, (ws[0] + ws[1]) / 2)
    card = (out / "README.md").read_text()
    assert "https://arxiv.org/abs/2212.09849" in card and "sha256" in card
    report = api.check(out, settings=api.Settings(state_dir=tmp_path / "state"))
    assert report.verdict == "works", report.reasons


@pytest.mark.slow
def test_a_killed_regmean_merge_resumes_identical_and_refuses_a_gram_changed_meanwhile(
        measured: dict[str, Path], tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "out"
    args = ("--state-dir", tmp_path / "state", "-q", "--out-shard-size", "20k")
    assert cli("run", measured["config"], reference, *args).returncode == 0  # processes: bytes compared
    killed = cli("run", measured["config"], out, *args, env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert killed.returncode == -9, killed.stderr
    gram = measured["grams"] / "model-01" / "layer-00001.safetensors"
    kept = gram.read_bytes()
    changed = bytearray(kept)
    changed[-1] ^= 1
    try:
        gram.write_bytes(bytes(changed))
        refused = cli_here("resume", out, *args[:2])
        assert refused.returncode != 0 and "holds other bytes" in refused.stderr, refused.stderr
    finally:
        gram.write_bytes(kept)
    assert cli("resume", out, *args[:3]).returncode == 0
    assert digests(out) == digests(reference) | {n: d for n, d in digests(out).items() if n.startswith("resumerge-")}


def test_a_gram_file_changed_since_it_was_measured_is_refused(measured: dict[str, Path], tmp_path: Path) -> None:
    grams, config = _copy(measured, tmp_path)
    target = grams / "model-01" / "layer-00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    _refused(config, tmp_path / "out", "changed since it was measured", "parameters.grams")


def test_a_missing_gram_file_and_an_unfinished_folder_are_refused(measured: dict[str, Path], tmp_path: Path) -> None:
    grams, config = _copy(measured, tmp_path)
    (grams / "model-00" / "layer-00000.safetensors").unlink()
    _refused(config, tmp_path / "out", "is missing")
    (grams / MANIFEST).unlink()
    _refused(config, tmp_path / "out", "no finished Gram measurement", "resumerge measure")


def test_a_gram_of_the_wrong_shape_or_missing_for_one_model_is_refused(measured: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    grams, config = _copy(measured, tmp_path)
    original = (grams / MANIFEST).read_text()
    doc = json.loads(original)
    doc["models"][1]["grams"]["model.layers.0.mlp.down_proj"][2] = 47
    (grams / MANIFEST).write_text(json.dumps(doc))
    _refused(config, tmp_path / "out", "47 × 47", "48 inputs")
    doc = json.loads(original)
    del doc["models"][1]["grams"]["model.layers.0.mlp.down_proj"]
    (grams / MANIFEST).write_text(json.dumps(doc))
    _refused(config, tmp_path / "out", "model.layers.0.mlp.down_proj.weight", "is missing")


def test_a_model_the_folder_did_not_measure_and_a_config_without_grams_are_refused(measured: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    c = make_model(tmp_path / "c", SPEC, seed=3)
    doc = {"merge_method": "regmean", "models": [{"model": str(measured["a"])}, {"model": str(c)}],
           "parameters": {"grams": str(measured["grams"])}}
    _refused(write_config(tmp_path / "c.yml", doc), tmp_path / "out", "holds no Grams of", str(c))
    del doc["parameters"]
    _refused(write_config(tmp_path / "none.yml", doc), tmp_path / "out", "grams")


def test_measure_refuses_a_folder_that_is_not_its_own_in_one_line(measured: dict[str, Path], tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    done = cli_here("measure", measured["config"], busy, "--texts", measured["texts"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "not an empty folder" in done.stderr and sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    other = tmp_path / "texts.txt"
    other.write_text("another text entirely\n")
    before = digests(measured["grams"])
    with pytest.raises(UsageError, match="other models, texts or versions"):
        api.measure(measured["config"], measured["grams"], texts=other)
    assert digests(measured["grams"]) == before


def test_measure_refuses_a_mixture_of_experts_in_one_line(tmp_path: Path) -> None:
    from moe_families import make_moe_model

    moe = make_moe_model(tmp_path / "moe", "qwen3_moe", 1)
    config = write_config(tmp_path / "moe.yml", {"merge_method": "regmean", "models": [{"model": str(moe)}],
                                                 "parameters": {"grams": "g"}})
    done = cli_here("measure", config, tmp_path / "g", "--texts", tmp_path / "none.txt")
    assert done.returncode == 2 and "mixture of experts" in done.stderr, done.stderr
    assert not (tmp_path / "g").exists()


@pytest.mark.slow
def test_a_killed_measurement_resumes_at_the_layer_reached_byte_identical(measured: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """Killed (SIGKILL) after the third of four layers (model 2's first): run again, it measures model 2's second
    layer only, and every file is the uninterrupted measurement's."""
    out = tmp_path / "grams"
    args = ("measure", measured["config"], out, "--texts", measured["texts"])
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_measure_layer:3"})
    assert killed.returncode == -9, killed.stderr
    assert not (out / MANIFEST).exists()
    # the journal is kept under the state dir (measures/<key>/journal), never in OUT_DIR
    journals = list(Path(os.environ["RESUMERGE_STATE_DIR"]).glob("measures/*/journal/model-01"))
    assert [p.name for p in journals[0].iterdir()] == ["hidden-00000.safetensors"]
    assert not (out / ".journal").exists()
    shown = api.status(out)
    assert (shown.state, shown.kind, shown.tensors_done, shown.tensors_total) == ("interrupted", "measure", 3, 4)
    assert shown.resume_command == f"resumerge measure {measured['config']} {out} --texts {measured['texts']}"
    assert "model 2 of 2" in str(shown)
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("measuring:") == 1 and "model 2 of 2, layer 2 of 2" in resumed.stderr
    for folder in ("", "model-00", "model-01"):
        assert digests(out / folder) == digests(measured["grams"] / folder), folder
    assert api.status(out).state == "done"
    assert not (out / ".journal").exists()


def test_a_base_plus_adapter_parent_is_refused_by_measure_and_by_the_merge(measured: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """The adapted model's files are its base's: the base's Grams must never be taken for it."""
    pytest.importorskip("peft")
    from lora.gen import make_adapter

    make_adapter(measured["a"], tmp_path / "lora", r=2, alpha=4, targets=["q_proj"], seed=5)
    doc = {"merge_method": "regmean", "models": [{"model": f"{measured['a']}+{tmp_path / 'lora'}"},
                                                 {"model": str(measured["b"])}],
           "parameters": {"grams": str(measured["grams"])}}
    config = write_config(tmp_path / "lora.yml", doc)
    with pytest.raises(UsageError, match="not a base\\+adapter reference"):
        api.measure(config, tmp_path / "g")
    assert not (tmp_path / "g").exists()
    _refused(config, tmp_path / "out", "base+adapter reference", "parameters.grams")
