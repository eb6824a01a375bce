"""GGUF inputs: each tensor decoded to float32 as gguf-py and transformers' GGUF loader decode it, under Hugging
Face names with the family's transforms, for each family and quant type; a real model (SmolLM2-135M-Instruct,
Q4_1) merged with its own Q8_0 re-encoding equals the merge of the decoded tensors; a GGUF-input merge killed
resumes byte-identical."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ggufmodels import HEAD_DIM, Q, decoded, hf_tensors, made_once, reference, to_gguf, write_gguf
from realmodel import smollm2_folder, smollm2_gguf
from safetensors.torch import load_file, save_file
from support import cli, cli_here, digests, write_config

from resumerge import api
from resumerge.api import Output
from resumerge.config.merge_config import load_config_text
from resumerge.config.modelref import ModelRef
from resumerge.errors import HostileFileError, ModelInputError
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CODECS, MAIN
from resumerge.inputs.gguf.codec import GgufCodec
from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.model import open_model
from resumerge.merge.plan.merge_plan import PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.workunits import row_step
from tests.moe.passthread import passes_on_a_thread

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe")
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.IQ4_XS)


def _same(got: torch.Tensor, want: np.ndarray | torch.Tensor, name: str) -> None:
    """``got`` equals ``want`` exactly (NaN equal to NaN). Values equal element for element, of the same dtype, pass
    at once (``assert_close`` with no tolerance took 5 CPU s over SmolLM2's 135M values to say so); any other pair is
    ``assert_close``'s to judge (a NaN, -0.0 against 0.0) and to explain."""
    want = want if isinstance(want, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(want))
    assert tuple(got.shape) == tuple(want.shape), name
    if got.dtype == want.dtype and torch.equal(got, want):
        return
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_float32_gguf_of_each_family_reads_back_as_the_hugging_face_weights_it_was_converted_from(
        tmp_path: Path, arch: str) -> None:
    # Names, llama's q/k permutation and gemma's +1 undone exactly: the HF tensors come back bit for bit.
    hf = hf_tensors(arch)
    write_gguf(tmp_path / "m.gguf", arch, to_gguf(arch, hf), Q.F32)
    model, got = decoded(tmp_path / "m.gguf")
    assert got.keys() == hf.keys()
    for name, value in hf.items():
        _same(got[name], value, name)
    assert model.config["model_type"] == {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    assert model.config["tie_word_embeddings"] is (arch == "gemma2")
    # What llama.cpp's forward of the family fixes and the config's defaults do not say (qwen3moe's top-k weights
    # divided by their sum): as transformers' own GGUF loader sets it.
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING

    fixed = GGUF_CONFIG_DEFAULTS_MAPPING.get(model.config["model_type"], {})
    assert {key: model.config.get(key) for key in fixed} == fixed
    assert model.config.get("norm_topk_prob") is (True if arch == "qwen3moe" else None)


# Every type on each family whose matrices decode otherwise: llama's permuted q/k (read in whole heads), a plain
# family (qwen3), gemma2's tied table, qwen3moe's expert stacks. qwen2's and gemma3's matrices are qwen3's (what sets
# them apart, biases and norms, are 1-D tensors, F32 in every file): read here as F32, and by the test above.
DECODED = [(arch, qtype) for arch in FAMILIES for qtype in TYPES if qtype == Q.F32 or arch not in ("qwen2", "gemma3")]


@pytest.mark.parametrize(("arch", "qtype"), DECODED, ids=[f"{arch}-{qtype.name}" for arch, qtype in DECODED])
def test_every_tensor_of_a_gguf_decodes_as_gguf_py_dequantizes_it_whole_or_by_row_chunks(
        tmp_path: Path, arch: str, qtype: Q) -> None:
    write_gguf(tmp_path / "m.gguf", arch, to_gguf(arch, hf_tensors(arch)), qtype)
    want = reference(tmp_path / "m.gguf")
    model, got = decoded(tmp_path / "m.gguf")
    assert got.keys() == want.keys()
    for name, value in want.items():
        _same(got[name], value, name)
    assert model.formats is not None
    # Row chunks: decoding rows [a, b) of the stored blocks gives rows [a, b) of the value (whole heads for a
    # permuted q/k), so a tensor read in chunks is the tensor read whole.
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        codec = model.formats.codec(name)
        assert isinstance(codec, GgufCodec)
        assert codec.read_block == (HEAD_DIM if arch == "llama" else 1)
        found = model.tensors[name]
        with open(tmp_path / "m.gguf", "rb") as file:
            file.seek(found.entry.start)
            raw = torch.frombuffer(bytearray(file.read(found.entry.nbytes)), dtype=torch.uint8)
        stored = raw.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}[
            found.entry.dtype]).reshape(found.entry.shape)
        step = HEAD_DIM
        chunks = [codec.decode({MAIN: stored[a:a + step]}, a) for a in range(0, stored.shape[0], step)]
        _same(torch.cat(chunks), want[name], name)


def test_the_planner_reads_a_permuted_q_in_whole_heads(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", "llama", to_gguf("llama", hf_tensors("llama")), Q.Q8_0)
    config = load_config_text(write_config(tmp_path / "c.yml", {
        "merge_method": "linear", "dtype": "float32",
        "models": [{"model": str(tmp_path / "m.gguf"), "parameters": {"weight": 1.0}}]}).read_text())
    plan = build_plan(config, open_inputs(config).models, PlanOptions(copy_tokenizer=False))
    assert row_step(plan.tensors["model.layers.0.self_attn.q_proj.weight"]) == HEAD_DIM
    assert row_step(plan.tensors["model.layers.0.self_attn.v_proj.weight"]) == 1
    assert all(tp.out_codec.plain for tp in plan.tensors.values())  # GGUF is read, never written, here
    assert "quantization_config" not in plan.out_config


def test_a_split_gguf_reads_as_the_one_file_it_was_split_from(tmp_path: Path) -> None:
    tensors = to_gguf("qwen3", hf_tensors("qwen3"))
    write_gguf(tmp_path / "one.gguf", "qwen3", tensors, Q.Q8_0)
    write_gguf(tmp_path / "split.gguf", "qwen3", tensors, Q.Q8_0, split_max_tensors=7)
    parts = sorted(p.name for p in tmp_path.glob("split-*.gguf"))
    assert len(parts) > 2 and parts[0] == f"split-00001-of-{len(parts):05d}.gguf"
    one, whole = decoded(tmp_path / "one.gguf")
    model, got = decoded(tmp_path / parts[0])
    assert [f.name for f in model.files] == parts
    assert {found.file for found in model.tensors.values()} == set(parts)
    assert got.keys() == whole.keys()
    assert all(torch.equal(got[name], whole[name]) for name in whole)
    assert {k: v for k, v in model.config.items() if k != "quantization_config"} == {
        k: v for k, v in one.config.items() if k != "quantization_config"}
    with pytest.raises(ModelInputError, match="is part 2 of a split GGUF"):
        decoded(tmp_path / parts[1])
    (tmp_path / parts[-1]).unlink()
    with pytest.raises(ModelInputError, match=f"split GGUF part {parts[-1]} is missing"):
        decoded(tmp_path / parts[0])


def test_gguf_and_safetensors_parents_of_one_family_mix(tmp_path: Path) -> None:
    # A Mistral GGUF (llama architecture, named Mistral) merged with the same weights as a Mistral safetensors
    # folder: the plan compares them as one architecture, and the merge is the weights themselves.
    hf = hf_tensors("llama")
    write_gguf(tmp_path / "m.gguf", "llama", to_gguf("llama", hf), Q.F32, name="Mistral-Tiny")
    folder = tmp_path / "folder"
    folder.mkdir()
    model, _ = decoded(tmp_path / "m.gguf")
    assert model.config["architectures"] == ["MistralForCausalLM"]
    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({n: torch.from_numpy(v) for n, v in hf.items()}, folder / "model.safetensors")
    out = tmp_path / "out"
    doc = {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(tmp_path / "m.gguf"), "parameters": {"weight": 0.5}},
        {"model": str(folder), "parameters": {"weight": 0.5}}]}
    api.run(write_config(tmp_path / "c.yml", doc), out, settings=api.Settings(state_dir=tmp_path / "s",
                                                                              output=Output(copy_tokenizer=False)))
    assert "GGUF F32 tensors, which mergekit 0.1.5 cannot read" in (out / "README.md").read_text()
    got = load_file(out / "model.safetensors")
    assert got.keys() == hf.keys()
    for name, value in hf.items():
        _same(got[name], value, name)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"] and "quantization_config" not in written


def test_an_unmapped_family_an_undecodable_type_and_a_damaged_file_are_refused_in_one_line(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelInputError, match="a GGUF of architecture 'phi3', which resumerge cannot map"):
        decoded(tmp_path / "phi.gguf")
    write_gguf(tmp_path / "m.gguf", "qwen2", to_gguf("qwen2", hf_tensors("qwen2")), Q.Q8_0)
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(HostileFileError, match="ends past the end of the file"):
        decoded(tmp_path / "cut.gguf")
    scaled = to_gguf("llama", hf_tensors("llama"))
    scaled["rope_freqs.weight"] = np.ones(HEAD_DIM // 2, np.float32)  # Llama 3.1's scaling, as the converter stores it
    write_gguf(tmp_path / "rope.gguf", "llama", scaled, Q.Q8_0)
    with pytest.raises(ModelInputError, match="a GGUF with scaled rope"):
        decoded(tmp_path / "rope.gguf")
    write_gguf(tmp_path / "q81.gguf", "qwen2", {"token_embd.weight": np.zeros((4, 32), np.float32)}, Q.Q8_1)
    with pytest.raises(ModelInputError, match="stored as ggml type 9, which this gguf package cannot decode"):
        decoded(tmp_path / "q81.gguf")


def test_a_lora_is_extracted_from_two_gguf_models(tmp_path: Path) -> None:
    # The same model reading path: the fine-tune and its base decoded as for a merge.
    for name, seed in (("ft", 1), ("base", 2)):
        write_gguf(tmp_path / f"{name}.gguf", "qwen2", to_gguf("qwen2", hf_tensors("qwen2", seed)), Q.Q8_0)
    out = tmp_path / "lora"
    api.extract_lora(str(tmp_path / "ft.gguf"), str(tmp_path / "base.gguf"), out,
                     settings=api.Settings(state_dir=tmp_path / "s"), lora=api.Lora(max_rank=4))
    factors = load_file(out / "adapter_model.safetensors")
    _, ft = decoded(tmp_path / "ft.gguf")
    _, base = decoded(tmp_path / "base.gguf")
    name = "model.layers.0.self_attn.q_proj"
    a, b = (factors[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
    delta = ft[f"{name}.weight"] - base[f"{name}.weight"]
    best = torch.linalg.svdvals(delta)[:4].square().sum() / delta.square().sum()
    # The factors hold the delta of the decoded tensors: the energy a best rank-4 approximation of it holds, to
    # the rounding of the stored factors (a wrong decoding captures next to none of it).
    captured = 1 - float((delta - (b @ a).float()).square().sum() / delta.square().sum())
    assert captured == pytest.approx(float(best), rel=0.05)


def _as_safetensors(path: Path, target: Path) -> Path:
    """The GGUF at ``path`` (F32) as the safetensors folder it was converted from: its weights, the config.json
    and tokenizer files rebuilt from its metadata (kept in the session's cache by its header, as a run keeps them:
    the same files the run's own plan of the GGUF reads there)."""
    from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

    target.mkdir()
    model, values = decoded(path)
    (target / "config.json").write_text(json.dumps({k: v for k, v in model.config.items()
                                                    if k != "quantization_config"}))
    for name, data in gguf_tokenizer_files(path, model.gguf_header).items():
        (target / name).write_bytes(data)
    save_file(values, target / "model.safetensors")
    return target


def _weights_of(out: Path) -> dict[str, torch.Tensor]:
    return {name: value for file in sorted(out.glob("*.safetensors")) for name, value in load_file(file).items()}


@pytest.mark.parametrize("gate_mode", ["random", "cheap_embed", pytest.param("hidden", marks=pytest.mark.slow)])
def test_moe_upcycling_of_gguf_models_equals_that_of_the_safetensors_they_were_converted_from(
        tmp_path: Path, gate_mode: str) -> None:
    from resumerge import api

    def upcycle(models: list[Path], name: str) -> Path:
        doc = {"base_model": str(models[0]), "gate_mode": gate_mode, "dtype": "float32", "experts": [
            {"source_model": str(models[1]), "positive_prompts": ["the cat sat on the mat", "a dog"]},
            {"source_model": str(models[2]), "positive_prompts": ["12 plus 30 is 42."]}]}
        out = tmp_path / name
        api.run(write_config(tmp_path / f"{name}.yml", doc), out,
                settings=api.Settings(state_dir=tmp_path / f"s-{name}"))
        return out

    ggufs = []
    for seed in range(3):  # llama: the q/k rows un-permuted on the way in
        # One name in three folders: the three headers are one (only the weights differ), so the tokenizer files
        # transformers rebuilds from them (~5 CPU s each) are rebuilt once for the session's cache, not once per
        # file and parametrization; every file's tokenizer is the same one either way.
        ggufs.append(tmp_path / f"g{seed}" / "m.gguf")
        ggufs[-1].parent.mkdir()
        write_gguf(ggufs[-1], "llama", to_gguf("llama", hf_tensors("llama", seed)), Q.F32)
    folders = [_as_safetensors(g, tmp_path / f"m{seed}") for seed, g in enumerate(ggufs)]
    with passes_on_a_thread():  # the hidden modes' prompt pass on a thread of this process: its process is not
        # what this compares (tests/moe/test_resume.py, test_surface.py), its routers read from GGUF files are
        from_gguf, from_folders = upcycle(ggufs, "from_gguf"), upcycle(folders, "from_folders")
    got, want = _weights_of(from_gguf), _weights_of(from_folders)
    assert got.keys() == want.keys() and any(".mlp.experts." in n for n in got)
    for name, value in want.items():
        if gate_mode == "hidden" and name.endswith("gate.weight"):  # the prompt pass's routers, run on each
            assert torch.allclose(got[name], value, atol=1e-5, rtol=0), name
        else:
            assert torch.equal(got[name], value), name
    assert json.loads((from_gguf / "config.json").read_text()) == json.loads(
        (from_folders / "config.json").read_text())
    tokenizer = sorted(p.name for p in from_folders.iterdir() if p.name.startswith(("tokenizer", "chat_template")))
    assert tokenizer and tokenizer == sorted(p.name for p in from_gguf.iterdir()
                                             if p.name.startswith(("tokenizer", "chat_template")))
    for file in tokenizer:  # the base's tokenizer rebuilt from its metadata, with mergekit-moe's pad token
        assert (from_gguf / file).read_bytes() == (from_folders / file).read_bytes(), file
    assert all(sorted(p.name for p in g.parent.iterdir()) == ["m.gguf"] for g in ggufs)  # nothing beside them


def test_a_gguf_tokenizer_transformers_cannot_rebuild_is_one_line_where_the_prompts_need_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge import api
    from resumerge.analyses.check.models import find_models
    from resumerge.config.locations import StateDir
    from resumerge.errors import UsageError
    from resumerge.forward.text.texts import load_tokenizer
    from resumerge.inputs.gguf import tokenizer

    real, failed = tokenizer._rebuilt, list[ModelInputError]()

    def rebuilt_once(path: Path, header: GgufHeader | None) -> dict[str, bytes]:
        """transformers' real failure on this file, its ModelInputError raised again at each later place that asks
        (a failure is never kept: each real attempt costs ~4 CPU s of importing transformers to fail again)."""
        if failed:
            raise failed[0]
        try:
            return real(path, header)
        except ModelInputError as exc:
            failed.append(exc)
            raise

    monkeypatch.setattr(tokenizer, "_rebuilt", rebuilt_once)
    write_gguf(tmp_path / "m.gguf", "llama", to_gguf("llama", hf_tensors("llama")), Q.F32, merges=("q z",))
    doc = {"base_model": str(tmp_path / "m.gguf"), "gate_mode": "cheap_embed", "dtype": "float32", "experts": [
        {"source_model": str(tmp_path / "m.gguf"), "positive_prompts": ["a"]},
        {"source_model": str(tmp_path / "m.gguf"), "positive_prompts": ["b"]}]}
    with pytest.raises(ModelInputError, match="gate_mode cheap_embed reads the prompts with the base's tokenizer: "
                                              "transformers cannot rebuild this GGUF's tokenizer"):
        api.plan_merge(write_config(tmp_path / "moe.yml", doc),
                       settings=api.Settings(merging=api.Merging(allow_same_experts=True)))
    with pytest.raises(ModelInputError, match="the output's tokenizer is the base's: transformers cannot rebuild"):
        api.plan_merge(write_config(tmp_path / "random.yml", {**doc, "gate_mode": "random"}),
                       settings=api.Settings(merging=api.Merging(allow_same_experts=True)))
    plan = api.plan_merge(write_config(tmp_path / "random.yml", {**doc, "gate_mode": "random"}),
                          settings=api.Settings(output=api.Output(copy_tokenizer=False),
                                                merging=api.Merging(allow_same_experts=True)))
    assert not plan.tokenizer_blobs
    models = find_models(tmp_path / "m.gguf", None, (), StateDir.resolve(tmp_path / "s"))
    with pytest.raises(UsageError, match=r"none of the checked models has a tokenizer .*cannot rebuild"):
        load_tokenizer([m.opened.directory for m in models])
    assert len(failed) == 1  # the real rebuild failed, once


def test_a_gguf_tokenizer_is_rebuilt_in_a_process_of_its_own(tmp_path: Path) -> None:
    """The rebuild (transformers' converter) leaves transformers unimported in the process that asked: a run's
    importance pass on a first run imported it for its GGUF donor's tokenizer and held 480 MB under a 362 MB budget
    (no budget counts transformers in a run of a family resumerge builds itself)."""
    import subprocess
    import sys

    write_gguf(tmp_path / "m.gguf", "llama", to_gguf("llama", hf_tensors("llama")), Q.F32)
    code = ("import sys\nfrom pathlib import Path\nfrom resumerge.config.modelref import ModelRef\n"
            "from resumerge.inputs.codecs import CODECS\nfrom resumerge.inputs.model import open_model\n"
            "from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files\npath = Path(sys.argv[1])\n"
            "model = open_model(ModelRef(str(path))).recognised(CODECS)\n"
            "made = gguf_tokenizer_files(path, model.gguf_header, Path(sys.argv[2]))\n"
            "print('tokenizer.json' in made, 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf"), str(tmp_path / "cache")],
                          capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"], done.stdout


def test_a_gguf_tokenizer_is_rebuilt_once_and_a_damaged_kept_copy_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A plan of a GGUF donor rebuilt its tokenizer through transformers every time (its import and a parse of the
    # whole vocabulary); the files are kept in the cache by the header and the makers' versions. The rebuild runs in
    # a process of its own (transformers never imported in the asking one): it is caught at its door, _rebuilt.
    from resumerge.inputs.gguf import tokenizer
    from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

    cache = tmp_path / "cache"
    for name, basename in (("m.gguf", ""), ("other.gguf", "Other")):
        write_gguf(tmp_path / name, "llama", to_gguf("llama", hf_tensors("llama")), Q.F32, name=basename)
    model, _ = decoded(tmp_path / "m.gguf")
    header = model.gguf_header
    assert header is not None
    made = gguf_tokenizer_files(tmp_path / "m.gguf", header)  # the session cache's (a tiny llama's: rebuilt once)
    assert "tokenizer.json" in made
    with monkeypatch.context() as patch:  # rebuilt for this cache as transformers rebuilt them there, ~5 CPU s sooner
        patch.setattr(tokenizer, "_rebuilt", lambda *args: made)
        assert gguf_tokenizer_files(tmp_path / "m.gguf", header, cache) == made
    (kept,) = (cache / "gguf-tokenizers").iterdir()

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt")

    rebuilds: list[Path] = []

    def rebuild(path: Path, *args: object) -> dict[str, bytes]:  # the rebuild above's files, ~5 CPU s sooner
        rebuilds.append(path)
        return made

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "_rebuilt", no_rebuild)
        assert gguf_tokenizer_files(tmp_path / "m.gguf", header, cache) == made  # kept: transformers never asked
        doc = json.loads(kept.read_text())
        doc["files"]["tokenizer.json"] = base64.b64encode(made["tokenizer.json"].replace(b"th", b"ht")).decode()
        kept.write_text(json.dumps(doc))  # its files no longer its digest's: rebuilt, never used
        with pytest.raises(AssertionError, match="rebuilt"):
            gguf_tokenizer_files(tmp_path / "m.gguf", header, cache)
        patch.setattr(tokenizer, "_rebuilt", rebuild)
        assert gguf_tokenizer_files(tmp_path / "m.gguf", header, cache) == made  # rebuilt, and kept again
    assert rebuilds == [tmp_path / "m.gguf"]
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "m.gguf", tmp_path / "copy" / "m.gguf")
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "_rebuilt", no_rebuild)
        assert gguf_tokenizer_files(tmp_path / "m.gguf", header, cache) == made  # kept again
        assert gguf_tokenizer_files(tmp_path / "copy" / "m.gguf", header, cache) == made  # the same file elsewhere
    other, _ = decoded(tmp_path / "other.gguf")  # another header (general.basename): kept apart
    assert other.gguf_header is not None
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "_rebuilt", rebuild)
        gguf_tokenizer_files(tmp_path / "other.gguf", other.gguf_header, cache)  # not m.gguf's kept files
    assert rebuilds[1:] == [tmp_path / "other.gguf"]
    assert len(list((cache / "gguf-tokenizers").iterdir())) == 2


def test_a_gguf_tokenizer_is_kept_by_the_key_values_alone_as_transformers_rebuilds_the_whole_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are kept by the key-values transformers is given: another encoding of the same model, a split set
    (other tensor infos, another name, the same key-values but the split's counts) takes the first one's kept
    files, which are the bytes transformers' own rebuild of that whole file (its tensors, name and split keys read)
    writes; a file whose tokenizer key-values differ (its chat template) is rebuilt. The first file's are the session
    cache's (every tiny llama GGUF of the suite has those key-values): rebuilt here only where no test did so."""
    from transformers import AutoTokenizer

    from resumerge.inputs.gguf import tokenizer
    from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

    def header(path: Path) -> GgufHeader:
        found = open_model(ModelRef(str(path))).recognised(CODECS).gguf_header
        assert found is not None
        return found

    first, other, templated = tmp_path / "m.gguf", tmp_path / "q8-00001-of-00003.gguf", tmp_path / "t.gguf"
    write_gguf(first, "llama", to_gguf("llama", hf_tensors("llama")), Q.F32)
    write_gguf(tmp_path / "q8.gguf", "llama", to_gguf("llama", hf_tensors("llama", 1)), Q.Q8_0, split_max_tensors=9)
    write_gguf(templated, "llama", to_gguf("llama", hf_tensors("llama")), Q.F32,
               chat_template="{{ messages[0].content }}")
    assert header(other).metadata["split.count"] == 3 and "split.count" not in header(first).metadata
    made = gguf_tokenizer_files(first, header(first))
    rebuilds: list[Path] = []

    def rebuild(path: Path, *args: object) -> dict[str, bytes]:
        rebuilds.append(path)
        return {}

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "_rebuilt", rebuild)
        assert gguf_tokenizer_files(other, header(other)) == made
        assert not rebuilds
        gguf_tokenizer_files(templated, header(templated))
        assert rebuilds == [templated]
    own = tmp_path / "own"
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=other.name, local_files_only=True).save_pretrained(own)
    assert {p.name: p.read_bytes() for p in own.iterdir()} == made


def test_without_gguf_py_a_gguf_input_exits_2_with_the_install_line(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", "qwen2", to_gguf("qwen2", hf_tensors("qwen2")), Q.F16)
    (tmp_path / "nogguf").mkdir()
    (tmp_path / "nogguf" / "gguf.py").write_text("raise ImportError('no gguf here')\n")
    write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(tmp_path / "m.gguf"), "parameters": {"weight": 1.0}}]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "nogguf"), os.environ.get("PYTHONPATH", "")])}
    done = cli("plan", tmp_path / "c.yml", env=env)
    assert done.returncode == 2, done.stderr
    assert "needs the gguf package" in done.stderr and "pip install -c constraints.txt -e '.[gguf]'" in done.stderr
    assert "Traceback" not in done.stderr


# --- the real model --------------------------------------------------------------------------------------------


def test_every_tensor_of_the_real_smollm2_gguf_equals_gguf_py_s_and_transformers_decoding() -> None:
    path = smollm2_gguf()
    want = load_file(_gguf_py_decoding("q4_1", path) / "model.safetensors")  # reference_real's, kept per machine
    folder = load_file(smollm2_folder() / "model.safetensors")
    model, got = decoded(path)
    assert got.keys() == want.keys() == folder.keys()
    for name, value in got.items():
        _same(value, want[name], name)
        assert torch.equal(value, folder[name]), name
    assert json.loads((smollm2_folder() / "config.json").read_text())["num_key_value_heads"] == \
        model.config["num_key_value_heads"]


def reference_real(path: Path) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of the SmolLM2 GGUF, mapped as transformers maps it (llama: q/k un-permuted)."""
    reader = gguf.GGUFReader(path)
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    out = {}
    for t in reader.tensors:
        value = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
            if parts[2] in ("attn_q", "attn_k"):
                n = heads if parts[2] == "attn_q" else kv
                value = value.reshape(n, value.shape[0] // n // 2, 2, -1).swapaxes(2, 1).reshape(value.shape)
        else:
            hf = f"{names[parts[0]]}.weight"
        out[hf] = value
    return out


def _requantized_q8_0(source: Path, target: Path) -> None:
    """``source`` re-encoded by gguf-py: every matrix Q8_0 from its float32 decoding, metadata copied."""
    reader = gguf.GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            items = [bytes(field.parts[i]).decode() if sub == gguf.GGUFValueType.STRING else field.parts[i][0]
                     for i in field.data]
            writer.add_key_value(name, items, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]).decode(), kind)
        else:
            writer.add_key_value(name, field.parts[-1][0], kind)
    for t in reader.tensors:
        value = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if value.ndim == 1:
            writer.add_tensor(t.name, value)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(value, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _decoded_folder(path: Path, target: Path) -> Path:
    """The GGUF at ``path`` decoded by gguf-py (mapped) as ``target``/model.safetensors: the oracle's values alone,
    no resumerge code taking part (its config.json is written beside each use, :func:`_as_model`)."""
    target.mkdir()
    save_file({n: torch.from_numpy(v) for n, v in reference_real(path).items()}, target / "model.safetensors")
    return target


def _gguf_py_decoding(name: str, path: Path) -> Path:
    """gguf-py's decoding of the real GGUF (``q4_1``) or of its Q8_0 re-encoding (``q8_0``, at ``path``): a folder
    holding its model.safetensors (:func:`_decoded_folder`), made once per machine: the oracle's ~6 CPU s of
    dequantizing."""
    return made_once(f"{name}-decoded", lambda folder: _decoded_folder(path, folder / "model"),
                     _requantized_q8_0, _decoded_folder, reference_real) / "model"


def _as_model(decoding: Path, path: Path, target: Path) -> Path:
    """A safetensors model folder at ``target``: the kept ``decoding``'s weights (linked, not copied: 540 MB) and
    the config.json resumerge reads from the GGUF at ``path`` now (never a kept copy of an older reading)."""
    target.mkdir()
    try:
        os.link(decoding / "model.safetensors", target / "model.safetensors")
    except OSError:  # another file system: a copy
        shutil.copyfile(decoding / "model.safetensors", target / "model.safetensors")
    config = open_model(ModelRef(str(path))).recognised(CODECS).config
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    return target


@pytest.fixture(scope="module")
def real() -> tuple[Path, Path]:
    """The real Q4_1 GGUF and gguf-py's Q8_0 re-encoding of it (made once per machine: ~14 s)."""
    q8 = made_once("q8_0", lambda folder: _requantized_q8_0(smollm2_gguf(), folder / "q8.gguf"), _requantized_q8_0)
    return smollm2_gguf(), q8 / "q8.gguf"


def _linear(tmp_path: Path, a: Path, b: Path) -> Path:
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})


_SHARD = "100MB"  # the real model's merge in six shards: the kill test kills inside the third


@pytest.fixture(scope="module")
def real_merge(tmp_path_factory: pytest.TempPathFactory, real: tuple[Path, Path]) -> tuple[Path, Path]:
    """The real GGUF merged with its Q8_0 re-encoding (tokenizer rebuilt from its metadata), once for the module's
    tests that read it (each had made it again: ~8 s a merge): its config and its OUT."""
    root = tmp_path_factory.mktemp("real_merge")
    config = _linear(root, *real)
    api.run(config, root / "whole", settings=api.Settings(state_dir=root / "s", output=Output(out_shard_size=_SHARD)))
    return config, root / "whole"


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name.startswith("model")}


def test_a_merge_of_the_real_gguf_with_its_q8_0_re_encoding_equals_the_merge_of_their_decodings(
        tmp_path: Path, real: tuple[Path, Path], real_merge: tuple[Path, Path]) -> None:
    q41, q8 = real
    from_gguf = real_merge[1]
    a, b = (_as_model(_gguf_py_decoding(name, path), path, tmp_path / name) for name, path in (("q4_1", q41),
                                                                                              ("q8_0", q8)))
    from_values = tmp_path / "from_values"
    (tmp_path / "v").mkdir()
    api.run(_linear(tmp_path / "v", a, b), from_values, settings=api.Settings(state_dir=tmp_path / "s2",
                                                                              output=Output(copy_tokenizer=False,
                                                                                            out_shard_size=_SHARD)))
    shards = _shards(from_gguf)  # every shard and the index, byte for byte
    assert len(shards) > 2 and shards == _shards(from_values)
    assert json.loads((from_gguf / "config.json").read_text()) == json.loads(
        (from_values / "config.json").read_text())


def test_a_gguf_parent_s_tokenizer_is_rebuilt_from_its_metadata(real_merge: tuple[Path, Path]) -> None:
    out = real_merge[1]
    for name in ("tokenizer.json", "chat_template.jinja"):  # transformers' own rebuild
        assert (out / name).read_bytes() == (smollm2_folder() / name).read_bytes(), name
    made = json.loads((out / "tokenizer_config.json").read_text())
    assert made.pop("local_files_only") is True  # resumerge never lets transformers reach the network
    assert made == {k: v for k, v in json.loads((smollm2_folder() / "tokenizer_config.json").read_text()).items()
                    if k != "local_files_only"}


def test_a_gguf_donor_s_tokenizer_takes_the_config_s_chat_template(tmp_path: Path,
                                                                   real: tuple[Path, Path]) -> None:
    from resumerge import api

    doc = {"merge_method": "linear", "dtype": "float32", "chat_template": "chatml", "models": [
        {"model": str(real[0]), "parameters": {"weight": 0.5}}, {"model": str(real[1]), "parameters": {"weight": 0.5}}]}
    plan = api.plan_merge(write_config(tmp_path / "c.yml", doc))
    template = plan.tokenizer_blobs["chat_template.jinja"].decode()
    assert template != (smollm2_folder() / "chat_template.jinja").read_text() and "<|im_start|>" in template
    assert plan.tokenizer_blobs["tokenizer.json"] == (smollm2_folder() / "tokenizer.json").read_bytes()
    with pytest.raises(ModelInputError, match="tokenizer_source cannot yet build a tokenizer from a GGUF model"):
        api.plan_merge(write_config(tmp_path / "u.yml", {**doc, "tokenizer_source": "union"}))


def test_a_gguf_input_merge_killed_resumes_byte_identical(tmp_path: Path, real_merge: tuple[Path, Path]) -> None:
    config, whole = real_merge
    out, state = tmp_path / "out", tmp_path / "s"
    # Killed while writing its third shard, then its resume killed after its second commit: the GGUF is read
    # again from the plan's recorded folder and file each time.
    for point, argv in (("mid_shard_write:3", ["run", config, out, "--state-dir", state, "--out-shard-size", _SHARD]),
                        ("after_ledger_commit:2", ["resume", out, "--state-dir", state])):
        killed = cli(*argv, env={"RESUMERGE_KILL_AT": point}, timeout=600)
        assert killed.returncode == -signal.SIGKILL, f"{point} was never reached: {killed.stderr}"
    api.resume(out, settings=api.Settings(state_dir=state))
    assert digests(out) == digests(whole)
    assert api.verify(out, settings=api.Settings(state_dir=state)).ok


def test_a_damaged_type_field_is_a_damaged_file_not_a_type_to_re_quantize(tmp_path: Path) -> None:
    """A type field holding no ggml type (a flipped high bit) was "a type this gguf package cannot decode —
    re-quantize it with llama-quantize" (issue 71, item 5): it is a damaged file, exit 2 naming file and tensor."""
    write_gguf(tmp_path / "m.gguf", "qwen2", to_gguf("qwen2", hf_tensors("qwen2")), Q.Q8_0)
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    field = at + 4 + 8 * n_dims
    assert int.from_bytes(data[field:field + 4], "little") == Q.Q8_0
    data[field + 3] ^= 0x40  # one flipped bit of the type's high byte
    (tmp_path / "m.gguf").write_bytes(data)
    config = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(tmp_path / "m.gguf")]})
    done = cli_here("run", config, tmp_path / "out", "--state-dir", tmp_path / "state")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    line = done.stderr
    assert "blk.0.attn_q.weight" in line and "no ggml type" in line and "m.gguf" in line, line
    assert "download it again" in line and "re-quantize" not in line, line
    assert not (tmp_path / "out").exists()
