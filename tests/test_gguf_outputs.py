"""GGUF outputs (``--out-type gguf``): one file whose header, offsets and size the plan fixes, every tensor byte-equal
to gguf-py's quantizer applied to the merged float32 values in llama.cpp's layout (names, q/k permutation, gemma's
+1), norms F32, the GGUF parent's tokenizer keys copied with their types; read back by gguf-py and transformers; a
run killed at any point resumes byte-identical and ``verify`` re-hashes it."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ggufmodels import Q, decoded, hf_tensors, made_once, name_maps_built_once, readers_built_once, to_gguf, write_gguf
from llamacpp_oracle import quantize
from realmodel import smollm2_folder, smollm2_gguf
from safetensors.torch import load_file, save_file
from support import cli, cli_here, digests, points_reached, write_config

from resumerge.inputs.gguf.ggmltypes import BY_NAME
from resumerge.machine.killpoints import LOCAL_POINTS
from resumerge.outputs.gguf.layout import STRING, TensorInfo, Value, plan_layout

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
TYPES = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q5_1": Q.Q5_1, "q5_0": Q.Q5_0, "q4_1": Q.Q4_1, "q4_0": Q.Q4_0}
# every family with the exact types and Q8_0; the 4- and 5-bit types on two families (llama's q/k permuted, gemma's
# norms +1). In this process, the merge of each family's parents made once (a CLI process each cost ~5 s a case).
CASES = [*((arch, kind) for arch in FAMILIES for kind in ("f16", "bf16", "q8_0")),
         *((arch, kind) for arch in ("llama", "gemma3") for kind in ("q5_1", "q5_0", "q4_1", "q4_0"))]


def _parents(root: Path, arch: str) -> tuple[Path, Path]:
    a, b = root / "a.gguf", root / "b.gguf"
    write_gguf(a, arch, to_gguf(arch, hf_tensors(arch, seed=1)), Q.F32)
    write_gguf(b, arch, to_gguf(arch, hf_tensors(arch, seed=2)), Q.F32)
    return a, b


def _config(root: Path, a: Path, b: Path) -> Path:
    return write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})


def _field(reader: gguf.GGUFReader, key: str) -> list[bytes]:
    field = reader.fields[key]
    return [bytes(np.asarray(part).tobytes()) for part in field.parts]


@pytest.fixture(scope="module")
def merged_as_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """Per family (made once for the module's cases): its two parents' merge config, and the same merge written as
    safetensors: the float32 values a GGUF output encodes."""
    from resumerge import api
    from resumerge.api import Output

    made: dict[str, tuple[Path, Path]] = {}

    def of(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            config = _config(root, *_parents(root, arch))
            api.run(config, root / "merged", settings=api.Settings(state_dir=root / "s",
                                                                   output=Output(copy_tokenizer=False)))
            made[arch] = config, root / "merged"
        return made[arch]

    return of


@pytest.mark.parametrize(("arch", "gguf_type"), CASES)
def test_every_tensor_of_a_gguf_output_is_gguf_py_s_encoding_of_the_merged_values(
        tmp_path: Path, arch: str, gguf_type: str, merged_as_safetensors: Callable[[str], tuple[Path, Path]]) -> None:
    from resumerge import api
    from resumerge.api import Output

    config, merged = merged_as_safetensors(arch)
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=tmp_path / "s", output=Output(out_type="gguf",
                                                                                       gguf_type=gguf_type)))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "mergekit_config.yml", "model.gguf",
                                                     "resumerge-manifest.json"]
    values = to_gguf(arch, {n: t.numpy() for n, t in load_file(merged / "model.safetensors").items()})
    reader = gguf.GGUFReader(out / "model.gguf")
    assert {t.name for t in reader.tensors} == set(values)
    for t in reader.tensors:
        want = values[t.name]
        if want.ndim == 1 or t.name.endswith("norm.weight"):
            assert t.tensor_type == Q.F32, t.name
            expected = want.astype(np.float32)
        else:
            kind = head_type(t.name, gguf_type, tied="output.weight" not in values)
            assert t.tensor_type == kind, t.name
            expected = quantize(want, kind) if kind == Q.Q6_K else gguf.quants.quantize(want, kind)
        assert np.asarray(t.data).tobytes() == np.ascontiguousarray(expected).tobytes(), t.name
    card = (out / "README.md").read_text()  # the card's note gives a quantized output's round-trip error
    assert ("round trip" in card) is gguf_type.startswith("q"), card
    if gguf_type.startswith("q"):
        assert f"{gguf_type.upper()} {BY_NAME[gguf_type.upper()].round_trip} % (the output)" in card
    parent = gguf.GGUFReader(config.parent / "a.gguf")
    for key in parent.fields:  # the tokenizer keys, types and bytes, as the parent has them
        if key.startswith("tokenizer."):
            assert _field(reader, key) == _field(parent, key), key
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == arch
    for key in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv"):
        assert _field(reader, f"{arch}.{key}") == _field(parent, f"{arch}.{key}"), key
    # resumerge reads its own output back as the merged values, to the rounding of the type
    _, got = decoded(out / "model.gguf")
    wanted = load_file(merged / "model.safetensors")
    assert got.keys() == wanted.keys() - ({"lm_head.weight"} if arch == "gemma2" else set())
    for name, value in got.items():
        step = 0.1 if gguf_type.startswith("q4") else 0.05 if gguf_type.startswith("q5") else 0.02
        torch.testing.assert_close(value, wanted[name], rtol=step, atol=step * float(wanted[name].abs().max()))


def head_type(name: str, gguf_type: str, *, tied: bool) -> Q:
    """A matrix's type in a ``gguf_type`` file of a dense model: llama.cpp's quantizer gives the head (and a tied
    embedding, which is the head) Q6_K in a 4- or 5-bit file (gguf-py cannot encode it: llama.cpp's own library
    is the reference); every other matrix the file's type."""
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    return Q.Q6_K if head and gguf_type[:2] in ("q4", "q5") else TYPES[gguf_type]


def test_a_planned_header_is_gguf_py_s_writer_s_prefix(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.ones((5, 64), np.float32), "output_norm.weight": np.ones(64, np.float32),
               "blk.0.attn_q.weight": gguf.quants.quantize(np.ones((3, 64), np.float32), Q.Q8_0)}
    writer = gguf.GGUFWriter(tmp_path / "w.gguf", "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_token_list(["a", "bc"])
    writer.add_token_scores([0.5, -1.0])
    writer.add_add_bos_token(True)
    for name, value in tensors.items():
        writer.add_tensor(name, value, raw_dtype=Q.Q8_0 if value.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kv = [("general.architecture", Value(8, "llama")), ("llama.block_count", Value(4, 1)),
          ("llama.rope.freq_base", Value(6, 10000.0)), ("tokenizer.ggml.tokens", Value(9, ["a", "bc"], 8)),
          ("tokenizer.ggml.scores", Value(9, [0.5, -1.0], 6)), ("tokenizer.ggml.add_bos_token", Value(7, True))]
    infos = [TensorInfo("token_embd.weight", (5, 64), 0, 5 * 64 * 4), TensorInfo("output_norm.weight", (64,), 0, 256),
             TensorInfo("blk.0.attn_q.weight", (3, 64), 8, 3 * 2 * 34)]
    layout = plan_layout(kv, infos)
    data = (tmp_path / "w.gguf").read_bytes()
    assert data[:len(layout.header)] == layout.header and len(data) == layout.file_size
    reader = gguf.GGUFReader(tmp_path / "w.gguf")
    assert [t.data_offset - reader.data_offset for t in reader.tensors] == list(layout.offsets)


@pytest.mark.parametrize("case", ["one", pytest.param("split", marks=pytest.mark.slow), "experts"])
def test_a_gguf_output_run_killed_anywhere_resumes_byte_identical(tmp_path: Path, case: str) -> None:
    from resumerge import api

    split = case == "split"
    a, b = _parents(tmp_path, "qwen3moe" if case == "experts" else "llama")
    config = _config(tmp_path, a, b)
    # split: gguf-split's files (tests/test_gguf_split.py), killed in a later file's write, rename and commit (the
    # one-file run walks every local point; these are what a split adds). experts: a qwen3moe output, each expert
    # written into its stacked tensor (tests/test_gguf_moe.py), killed with the stacks part written and after
    flags = ["--out-type", "gguf", "--gguf-type", "q8_0", *(["--gguf-split-max-size", "40000"] if split else [])]
    whole = tmp_path / "whole"  # never killed: in this process
    with points_reached() as reached:
        api.run(config, whole, settings=api.Settings(state_dir=tmp_path / "s0", output=api.Output(
            out_type="gguf", gguf_type="q8_0", **({"gguf_split_max_size": "40000"} if split else {}))))
    assert len(list(whole.glob("*.gguf"))) == (15 if split else 1)
    # one: every local point the run reaches (a one-file output without config.json or tokenizer reaches no
    # index's or tokenizer's write: a run killed there would merge to the end)
    points = (("mid_shard_write:3", "after_rename:4", "after_ledger_commit:2") if split else
              ("mid_shard_write", "after_temp_write") if case == "experts" else
              tuple(point for point in LOCAL_POINTS if point in reached))
    assert {point.partition(":")[0] for point in points} <= set(reached)
    assert {"mid_shard_write", "after_temp_write", "after_rename", "after_ledger_commit"} <= set(reached)
    for point in points:
        out, state = tmp_path / point.replace(":", "_"), tmp_path / f"{point.replace(':', '_')}.state"
        killed = cli("run", config, out, "--state-dir", state, *flags, env={"RESUMERGE_KILL_AT": point})
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        # never killed: in this process (two process starts a point saved)
        api.resume(out, api.Settings(state_dir=state))
        assert digests(out) == digests(whole), point
        assert api.verify(out, settings=api.Settings(state_dir=state)).ok, point


def test_a_gguf_output_takes_the_config_s_chat_template(tmp_path: Path) -> None:
    from resumerge import api

    a, b = _parents(tmp_path, "qwen2")
    template = "{% for m in messages %}mine{% endfor %}"
    doc = {"merge_method": "linear", "dtype": "float32", "chat_template": template, "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}
    out = tmp_path / "out"
    api.run(write_config(tmp_path / "c.yml", doc), out, settings=api.Settings(state_dir=tmp_path / "s",
                                                                              output=api.Output(out_type="gguf")))
    reader = gguf.GGUFReader(out / "model.gguf")
    assert bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode() == template
    assert _field(reader, "tokenizer.ggml.tokens") == _field(gguf.GGUFReader(a), "tokenizer.ggml.tokens")


def test_a_damaged_gguf_output_is_found_by_verify(tmp_path: Path) -> None:
    from resumerge import api

    a, b = _parents(tmp_path, "qwen3")
    out, state = tmp_path / "out", tmp_path / "s"
    # verify's CLI tested
    api.run(_config(tmp_path, a, b), out, api.Settings(state_dir=state, output=api.Output(out_type="gguf")))
    data = bytearray((out / "model.gguf").read_bytes())
    data[-40] ^= 1
    (out / "model.gguf").write_bytes(bytes(data))
    done = cli_here("verify", out, "--state-dir", state)  # the CLI's main, here
    assert done.returncode != 0 and "model.gguf" in done.stdout + done.stderr


def test_a_gguf_output_without_a_tokenizer_or_of_an_unwritable_family_is_refused(tmp_path: Path) -> None:
    from moe_families import make_moe_model

    deepseek = make_moe_model(tmp_path / "deepseek", "deepseek_v3", seed=0)
    done = cli_here("plan", _config(tmp_path, deepseek, deepseek), "--out-type", "gguf")  # no interpreter started
    assert done.returncode == 2 and "a GGUF output of a deepseek_v3 model, which resumerge cannot write" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "q").mkdir()
    model, values = decoded(_parents(tmp_path / "q", "qwen3")[0])
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in model.config.items()
                                                    if k != "quantization_config"}))
    save_file(values, folder / "model.safetensors")
    done = cli_here("plan", _config(tmp_path / "q", folder, folder), "--out-type", "gguf")  # the CLI's main, here
    # no GGUF parent: the tokenizer is built from the donor's files, and this folder has none
    assert done.returncode == 2 and "a GGUF output needs the model's tokenizer.json" in done.stderr
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    done = cli_here("plan", _config(tmp_path / "q", folder, folder), "--out-type", "gguf")
    # a byte-level BPE whose pre-tokenizer llama.cpp's table does not name: a GGUF of it would split text wrongly
    assert done.returncode == 2 and "pre-tokenizer llama.cpp's table does not name" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_real_model_merged_to_gguf_loads_in_transformers_as_resumerge_reads_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from resumerge import api

    source = smollm2_gguf()
    out = tmp_path / "out"
    # the linear merge of its first 8 of 30 layers with themselves: every tensor's shape and kind (the 30 took ~6
    # CPU s more, in the merge, transformers' dequantization and the comparison)
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "slices": [{"sources": [
        {"model": str(source), "layer_range": [0, 8], "parameters": {"weight": w}} for w in (0.3, 0.7)]}]})
    # in this process: a process start saved
    api.run(config, out, api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf", gguf_type="q8_0")))
    _, got = decoded(out / "model.gguf")
    with name_maps_built_once(), readers_built_once():  # one parse of the file for the model's config and weights
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    state = model.state_dict()
    assert model.config.num_hidden_layers == 8 and set(got) <= set(state)
    assert all(torch.equal(state[name], value) for name, value in got.items())
    original = load_file(smollm2_folder() / "model.safetensors")  # Q4_1 values re-encoded as Q8_0: close
    for name, value in got.items():  # assert_close's |a - b| <= atol in one pass (it took 8 s over these 135M values)
        want = original[name]
        assert value.shape == want.shape and value.dtype == want.dtype, name
        # the difference's magnitude in place and the original's largest one from its extremes: no temporary of the
        # original's absolute values (4.3 -> 2.5 CPU s over the model); a NaN in either makes its figure NaN
        low, high = torch.aminmax(want)
        worst, atol = float(torch.sub(value, want).abs_().max()), 0.01 * max(-float(low), float(high))
        assert worst <= atol, (name, worst, atol)  # a NaN fails too


def test_a_gguf_output_of_safetensors_parents_carries_their_tokenizer_as_llama_cpp_writes_it(tmp_path: Path) -> None:
    """The commonest path: Hugging Face parents in, a GGUF out. Its ``tokenizer.*`` keys are those llama.cpp's
    converter wrote into the real SmolLM2 GGUF (model gpt2, pre smollm, tokens, types, merges, special ids, chat
    template), and transformers reads the written GGUF as the same tokenizer and the same model as the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resumerge import api

    folder = smollm2_folder()
    out = tmp_path / "out"
    api.run(_config(tmp_path, folder, folder), out, settings=api.Settings(state_dir=tmp_path / "s",
                                                                          output=api.Output(out_type="gguf",
                                                                                            gguf_type="f16")))
    # the written file parsed once by gguf-py, for this test's reading of its keys and transformers' three (the
    # tokenizer's config, the model's config, its weights)
    with readers_built_once():
        ours = {k: v for k, v in _metadata(out / "model.gguf").items() if k.startswith("tokenizer.")}
        theirs = _real_tokenizer_keys()
        # add_space_prefix: a SentencePiece key the converter does not write for a gpt2 vocabulary (llama.cpp's
        # default for it is false, the value the original holds); add_eos_token: false, as the tokenizer does.
        assert theirs.pop("tokenizer.ggml.add_space_prefix") == [False]
        assert ours.pop("tokenizer.ggml.add_eos_token") == [False]
        assert ours == theirs
        assert ours["tokenizer.ggml.pre"] == ["smollm"] and len(ours["tokenizer.ggml.tokens"]) == 49152

        gguf_tokenizer = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
        hf_tokenizer = AutoTokenizer.from_pretrained(folder)
        texts = ["Hello, world! 12345 naïve café", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", " \t\n  x"]
        for text in texts:
            assert gguf_tokenizer(text)["input_ids"] == hf_tokenizer(text)["input_ids"], text
        chat = [{"role": "user", "content": "Hi"}]
        assert (gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        with name_maps_built_once():
            model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # the folder's weights as the GGUF holds them: matrices in F16, norms in F32
        for param in reference.parameters():
            if param.dim() == 2:
                param.copy_(param.half().float())
    state, expected = model.state_dict(), reference.state_dict()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    ids = torch.tensor([hf_tokenizer(texts[1])["input_ids"]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # the same float32 weights and the same code: only the order of float32 sums may differ
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _metadata(path: Path) -> dict[str, list[object]]:
    reader = gguf.GGUFReader(path)
    contents = {key: field.contents() for key, field in reader.fields.items()}  # once: a list is built at each call
    return {key: value if isinstance(value, list) else [value] for key, value in contents.items()}


def _real_tokenizer_keys() -> dict[str, list[object]]:
    """The real GGUF's ``tokenizer.*`` keys as gguf-py reads them (:func:`_metadata`), read once per machine beside
    realmodel's caches (a parse of its vocabulary and merges: ~3 CPU s) and kept as JSON (strings, ints, bools: the
    same values back); no resumerge code takes part."""

    def make(folder: Path) -> None:
        keys = {k: v for k, v in _metadata(smollm2_gguf()).items() if k.startswith("tokenizer.")}
        (folder / "keys.json").write_text(json.dumps(keys))

    kept = made_once("tokenizer-keys", make, _metadata) / "keys.json"
    found: dict[str, list[object]] = json.loads(kept.read_text())
    return found


def test_a_release_builds_its_tokenizer_keys_once_for_all_its_files(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A release plans one GGUF per type from one tokenizer: its keys are built once (the tokenizer loaded, 49,152
    tokens and their merges read: a third of the plan's one-thread start), each file given its own list of them;
    a tokenizer file changed since is read again; nothing is kept past the release's planning (the run's memory
    counts none of it)."""
    import shutil

    from resumerge.outputs.gguf import hfvocab

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, folder / name)
    builds: list[Path] = []
    built = hfvocab._built
    monkeypatch.setattr(hfvocab, "_built", lambda *args: builds.append(args[0]) or built(*args))
    with hfvocab.built_once():  # as a release plans its files
        first = hfvocab.tokenizer_keys(folder, 49152, None)
        second = hfvocab.tokenizer_keys(folder, 49152, None)
        assert len(builds) == 1 and first == second and first is not second
        second.append(("x", second[0][1]))  # a file's list is its own
        assert hfvocab.tokenizer_keys(folder, 49152, None) == first
        assert hfvocab.tokenizer_keys(folder, 49152, "{{ x }}")[-1] == ("tokenizer.chat_template",
                                                                         Value(STRING, "{{ x }}"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ changed }}"}))
        assert dict(hfvocab.tokenizer_keys(folder, 49152, None))["tokenizer.chat_template"] == Value(STRING,
                                                                                                     "{{ changed }}")
        assert len(builds) == 3
    hfvocab.tokenizer_keys(folder, 49152, None)  # outside a release's planning nothing is kept
    assert len(builds) == 4


def test_the_token_list_of_a_built_gguf_vocabulary_follows_llama_cpp_s_converter(tmp_path: Path) -> None:
    """Ids past the tokenizer are ``[PAD{i}]`` (unused), added tokens control when special or ``<|…|>``-shaped and
    user-defined otherwise, the rest normal: what llama.cpp's converter writes (the real model has none of the
    first two)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from resumerge.outputs.gguf.hfvocab import _tokens

    tokenizer = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.add_tokens([AddedToken("<|tool|>", special=False), AddedToken("extra", special=False)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    tokens, types = _tokens(Tokenizer.from_file(str(tmp_path / "tokenizer.json")), data, 8)
    assert tokens == ["a", "b", "ab", "<s>", "<|tool|>", "extra", "[PAD6]", "[PAD7]"]
    assert types == [1, 1, 1, 3, 3, 4, 5, 5]


def test_every_gguf_type_the_cli_offers_has_an_encoder() -> None:
    from resumerge.inputs.gguf.ggmltypes import TYPES as GGML_TYPES
    from resumerge.merge.plan.defaults import GGUF_TYPES
    from resumerge.merge.plan.gguftypes import MIXES
    from resumerge.outputs.gguf import kquants

    assert set(GGUF_TYPES) == set(MIXES) - {"f32"} and set(TYPES) <= set(GGUF_TYPES)
    assert all(GGML_TYPES[MIXES[kind].default].is_block for kind in GGUF_TYPES if not kind.endswith("16"))
    assert set(kquants.K_TYPES) <= {code for code, row in GGML_TYPES.items() if row.is_block}


def test_quantized_gguf_parents_are_noted_with_their_round_trip_error() -> None:
    from resumerge.inputs.gguf.codec import GgufCodec
    from resumerge.merge.plan.quantnotes import gguf_error_notes

    (note,) = gguf_error_notes([GgufCodec("Q4_1", (32, 20)), GgufCodec("F32", (1, 4)), GgufCodec("Q6_K", (256, 210))],
                               {})
    assert "Q4_1 7.9 % (parents), Q6_K 1.8 % (parents)" in note
    assert gguf_error_notes([GgufCodec("F16", (1, 2))], {}) == []


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_1", "bf16"])
def test_a_tensor_computed_in_workspace_row_chunks_is_byte_identical_to_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_type: str) -> None:
    # Quantized parents and output: a tensor over WORKSPACE_CHUNK_BYTES is computed in row chunks of about that
    # much (whole heads for llama's permuted q/k, whole blocks), each in the worker's reused buffers.
    from resumerge import api
    from resumerge.merge.engine import compute

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.Q4_1)
    write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.Q8_0)
    config = _config(tmp_path, a, b)
    output = api.Output(out_type="gguf", gguf_type=gguf_type)
    api.run(config, tmp_path / "whole", settings=api.Settings(state_dir=tmp_path / "s1", output=output))
    chunks: list[int] = []
    cut = compute.TensorCompute._workspace_chunks
    monkeypatch.setattr(compute.TensorCompute, "_workspace_chunks",
                        lambda self, first, stop: chunks.append(len(found := cut(self, first, stop))) or found)
    monkeypatch.setattr(compute, "WORKSPACE_CHUNK_BYTES", 4096)
    api.run(config, tmp_path / "chunked", settings=api.Settings(state_dir=tmp_path / "s2", output=output))
    assert max(chunks) > 4  # the test's tensors were cut
    assert (tmp_path / "chunked" / "model.gguf").read_bytes() == (tmp_path / "whole" / "model.gguf").read_bytes()


@pytest.mark.parametrize("ggml_type", [0, 1])  # F32, F16
@pytest.mark.parametrize("transform", ["", "permute"])
def test_f16_and_f32_cast_a_merge_straight_to_the_bytes_of_the_float32_path(monkeypatch: pytest.MonkeyPatch,
                                                                            ggml_type: int, transform: str) -> None:
    # The float32 path copied a bfloat16 merge to a fresh float32 tensor, then to a fresh float16 one (and a q/k
    # permutation to a third): the F16 merge's largest source of fresh pages. Straight, every bfloat16 bit pattern
    # and float32 ones at random (NaNs with payloads among them) give its bytes, by encode and by encode_into; a
    # float16 value to F16 keeps the float32 path (a NaN's payload comes out quieted through it).
    from resumerge.outputs.gguf.outcodec import GgufOutCodec

    codec = GgufOutCodec("blk.0.attn_q.weight", ggml_type, transform, 16)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (256, 96), generator=torch.Generator().manual_seed(3))
    values = [every, bits.to(torch.int32).view(torch.float32), every.t().contiguous().t()]  # the last one strided
    expected = [codec._encoded(codec._gguf_values(v), codec.gguf_name).view(torch.uint8) for v in values]
    half = (torch.randn(64, 32) * 1e3).half()
    expected_half = codec._encoded(codec._gguf_values(half), codec.gguf_name).view(torch.uint8)
    through = GgufOutCodec._gguf_values

    def refused(self: GgufOutCodec, value: torch.Tensor, lend: object = None) -> torch.Tensor:
        assert value.dtype == torch.float16 and ggml_type == 1, "cast through float32"
        return through(self, value)

    monkeypatch.setattr(GgufOutCodec, "_gguf_values", refused)
    for value, want in [*zip(values, expected), (half, expected_half)]:
        assert torch.equal(codec.encode(value, "bfloat16")["main"].view(torch.uint8), want)
        into = torch.full(want.shape, 7, dtype=torch.uint8)
        codec.encode_into(value, "bfloat16", {"main": into.view(torch.float32 if ggml_type == 0 else torch.float16)})
        assert torch.equal(into, want)
