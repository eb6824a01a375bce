"""The importance matrix of a mixture of experts (issue 84): ``run --out-type gguf --imatrix-texts`` of a merge of two
tiny Qwen3-MoE models sums each expert's inputs over the tokens routed to it, with a count per expert, as
llama-imatrix records a ``MUL_MAT_ID`` (``kquants.md`` §4): ``ffn_gate_exps``/``ffn_up_exps`` one row of n_embd values
per expert, ``ffn_down_exps`` one of n_ff. Checked against a hand computation on the merge written as safetensors
(every token routed by the router's top-k, each chosen expert's inputs accumulated), and against llama.cpp's own
quantizer given the same matrix (the same bytes); a fused checkpoint's stacks (transformers 5's
``experts.gate_up_proj``) are weighted per expert as the per-expert tensors are, whole or in row chunks of experts; a
kill in the pass resumes to the same bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import gguf
import numpy as np
import pytest
import test_imatrix_merge as dense
import torch
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from llamacpp_oracle import needs_library, quantize_model
from safetensors.torch import load_file, save_file
from support import cli, write_config

from resumerge import api
from resumerge.merge.plan.gguftypes import MIXES
from resumerge.outputs.gguf.imatrix import read_imatrix

TEXTS = "the cat sat on the mat.\nthree plus four is seven.\nabc def ghi 123 456\nzz yy xx ww vv uu\n"
K_MIX = ("--out-type", "gguf", "--gguf-type", "q4_k_m")


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float16 linear merge of two tiny Qwen3-MoE GGUFs (3 experts, 2 used a token) and calibration texts."""
    root = tmp_path_factory.mktemp("moe")
    paths = []
    for seed in (1, 2):  # named as the other tests' qwen3moe parents: their tokenizer is rebuilt once a session
        paths.append(root / f"{'ab'[seed - 1]}.gguf")
        write_gguf(paths[-1], "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=seed)), Q.F32)
    config = write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float16", "models": [
        {"model": str(p), "parameters": {"weight": w}} for p, w in zip(paths, (0.4, 0.6))]})
    texts = root / "texts.txt"
    texts.write_text(TEXTS)
    return config, texts


# test_imatrix_merge's two runs of the merge (to Q4_K_M with its matrix, and to safetensors), each resolved against
# this module's ``merge``.
computed, written = dense.computed, dense.written


def _by_hand(written: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per GGUF weight, llama-imatrix's sums and counts over the texts computed by hand on the written merge:
    transformers runs it (its hidden states entering each MoE block taken), and each token is routed here, one at
    a time, by the router's softmax top-k; each chosen expert adds the token's squares to its gate/up row and the
    squares of silu(gate)·up to its down row, and one to its count. The attention's and the router's entries sum
    every token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(written)
    config = model.config
    entering: dict[int, list[torch.Tensor]] = {}
    linears: dict[str, torch.Tensor] = {}

    def block(index: int):  # type: ignore[no-untyped-def]
        def hook(module: object, args: tuple[torch.Tensor, ...]) -> None:
            entering.setdefault(index, []).append(args[0].reshape(-1, args[0].shape[-1]).double())
        return hook

    def linear(name: str):  # type: ignore[no-untyped-def]
        def hook(module: object, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            linears[name] = linears.get(name, 0) + (x * x).sum(0)
        return hook

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(block(i))
        for short, gguf_short in names.items():
            getattr(layer.self_attn, short).register_forward_pre_hook(linear(f"blk.{i}.{gguf_short}.weight"))
    tokens = 0
    for line in TEXTS.splitlines():
        ids = tokenizer(line, return_tensors="pt").input_ids
        tokens += ids.shape[1]
        with torch.no_grad():
            model(ids)
    sums = {name: value.numpy() for name, value in linears.items()}
    counts = {name: np.array([tokens], np.float64) for name in linears}
    experts, used = config.num_experts, config.num_experts_per_tok
    for i, layer in enumerate(model.model.layers):
        router = layer.mlp.gate.weight.detach().double()
        gate_up, down_width = layer.mlp.experts.gate_up_proj.detach().double(), layer.mlp.experts.down_proj.shape[-1]
        half = gate_up.shape[1] // 2
        inputs = np.zeros((experts, router.shape[1]))
        inners = np.zeros((experts, down_width))
        routed = np.zeros(experts)
        every = torch.cat(entering[i])
        for x in every:  # one token at a time
            chosen = torch.topk(torch.softmax(router @ x, dim=-1), used).indices.tolist()
            for e in chosen:
                inner = torch.nn.functional.silu(gate_up[e, :half] @ x) * (gate_up[e, half:] @ x)
                inputs[e] += (x * x).numpy()
                inners[e] += (inner * inner).numpy()
                routed[e] += 1
        for part in ("gate", "up"):
            sums[f"blk.{i}.ffn_{part}_exps.weight"], counts[f"blk.{i}.ffn_{part}_exps.weight"] = inputs, routed
        sums[f"blk.{i}.ffn_down_exps.weight"], counts[f"blk.{i}.ffn_down_exps.weight"] = inners, routed
        sums[f"blk.{i}.ffn_gate_inp.weight"] = (every * every).sum(0).numpy()
        counts[f"blk.{i}.ffn_gate_inp.weight"] = np.array([every.shape[0]], np.float64)
    return sums, counts


def test_each_expert_sums_the_inputs_routed_to_it_as_a_hand_computation_does(
        computed: tuple[Path, Path], written: Path) -> None:
    """The matrix's raw sums and counts (llama-imatrix's ``in_sum2`` [E, n_in] and ``counts`` [E]) equal the hand
    computation's, to float tolerance, for every entry: attention, routers and the three expert stacks; and read as
    llama-quantize reads them, each expert's slice is its sums over its count."""
    _, matrix = computed
    sums, counts = _by_hand(written)
    reader = gguf.GGUFReader(matrix)
    raw = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    assert sorted(n.removesuffix(".in_sum2") for n in raw if n.endswith(".in_sum2")) == sorted(sums)
    for name, want in sums.items():
        got = raw[f"{name}.in_sum2"].reshape(np.shape(want) if np.ndim(want) == 2 else (1, -1))
        # (the pass computes in float32, the hand in float64: a float32 matmul's rounding)
        assert np.allclose(got, np.reshape(want, got.shape), rtol=1e-4, atol=1e-6), name
        assert np.array_equal(raw[f"{name}.counts"].reshape(-1), counts[name]), name
    routed = counts["blk.0.ffn_down_exps.weight"]
    assert routed.sum() == 2 * counts["blk.0.attn_q.weight"][0]  # two experts a token
    read = read_imatrix(matrix)["blk.1.ffn_down_exps.weight"].reshape(len(routed), -1)
    for e, count in enumerate(counts["blk.1.ffn_down_exps.weight"]):
        want = sums["blk.1.ffn_down_exps.weight"][e] / count if count else np.ones(read.shape[1])
        assert np.allclose(read[e], want, rtol=1e-4, atol=1e-7), e


def _gguf_bytes(path: Path) -> dict[str, tuple[int, bytes]]:
    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def test_the_moe_merge_is_encoded_as_llama_quantize_encodes_it_with_that_matrix(
        merge: tuple[Path, Path], computed: tuple[Path, Path], tmp_path: Path) -> None:
    """llama_model_quantize of the merge's F16 GGUF given the computed matrix writes the very bytes the run wrote,
    each expert of a stack weighted by its own slice; without the matrix the experts' bytes differ."""
    needs_library()
    config, _ = merge
    out, matrix = computed
    api.run(config, tmp_path / "f16",
            api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf", gguf_type="f16")))
    f16 = tmp_path / "f16" / "model.gguf"
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type, imatrix=read_imatrix(matrix))
    ours, theirs = _gguf_bytes(out / "model.gguf"), _gguf_bytes(tmp_path / "llama.gguf")
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []
    quantize_model(f16, tmp_path / "plain.gguf", MIXES["q4_k_m"].file_type)
    plain = _gguf_bytes(tmp_path / "plain.gguf")
    assert all(ours[n] != plain[n] for n in plain if "_exps" in n)


def _fuse(folder: Path) -> None:
    """``folder``'s per-expert tensors as transformers 5 holds a Qwen3-MoE's: each layer's experts fused into
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj`` [E, H, I]."""
    tensors = load_file(folder / "model.safetensors")
    experts = json.loads((folder / "config.json").read_text())["num_local_experts"]
    fused = {name: value for name, value in tensors.items() if ".experts." not in name}
    for layer in sorted({n.split(".")[2] for n in tensors if ".experts." in n}):
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.{x}_proj.weight"] for x in ("gate", "up")])
                                                 for e in range(experts)])
        fused[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(experts)])
    save_file(fused, folder / "model.safetensors", metadata={"format": "pt"})


def _tiny_qwen3_moe(folder: Path) -> Path:
    """A tiny float16 Qwen3-MoE (3 experts, 2 a token; widths of whole K-quant blocks) with SmolLM2's tokenizer (a
    pre-tokenizer llama.cpp's table names), its experts stored fused."""
    from realmodel import smollm2_folder
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  vocab_size=49152, num_experts=3, num_experts_per_tok=2, max_position_embeddings=128,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                  norm_topk_prob=True)  # as Qwen3-MoE ships: llama.cpp's qwen3moe renormalises
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).half().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, folder / name)
    _fuse(folder)
    return folder


@pytest.mark.slow
def test_a_fused_checkpoint_s_stacks_are_weighted_per_expert_by_the_matrix_computed_on_them(
        merge: tuple[Path, Path], tmp_path: Path) -> None:
    """A merge of a checkpoint whose experts are transformers 5's fused stacks (``experts.gate_up_proj``, written
    whole as two GGUF stacks): ``--imatrix-texts`` computes each expert's entry, and llama_model_quantize of the
    merge's F16 GGUF given that matrix writes the very bytes the run wrote, each expert weighted by its slice."""
    needs_library()
    _, texts = merge
    model = _tiny_qwen3_moe(tmp_path / "fused")
    config = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [{"model": str(model)}]})
    api.run(config, tmp_path / "q", api.Settings(
        state_dir=tmp_path / "s", output=api.Output(out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    (matrix,) = (tmp_path / "s" / "imatrix").glob("*.gguf")
    entries = read_imatrix(matrix)
    assert entries["blk.0.ffn_gate_exps.weight"].size == 3 * 256
    api.run(config, tmp_path / "f16",
            api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf", gguf_type="f16")))
    quantize_model(tmp_path / "f16" / "model.gguf", tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type,
                   imatrix=entries)
    ours, theirs = _gguf_bytes(tmp_path / "q" / "model.gguf"), _gguf_bytes(tmp_path / "llama.gguf")
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []


def test_a_chunk_of_a_stack_weights_each_expert_by_its_own_slice(computed: tuple[Path, Path]) -> None:
    """The engine's row chunk of a stack written whole (experts first..stop) is encoded with its chunk's codec
    (``from_row``): its bytes are those rows of the whole stack's, each expert weighted by its own slice; a codec
    blind to the chunk's first expert would weight them by the first experts' slices."""
    from resumerge.outputs.gguf.outcodec import GgufOutCodec

    _, matrix = computed
    stack = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 256, 512)).astype(np.float32))
    codec = GgufOutCodec("blk.0.ffn_down_exps.weight", 12, imatrix=str(matrix))  # Q4_K
    whole = codec.encode(stack, "F32")["main"]
    chunk = codec.from_row(1).encode(stack[1:], "F32")["main"]
    assert torch.equal(chunk, whole[1:])
    assert not torch.equal(codec.encode(stack[1:], "F32")["main"], whole[1:])
    assert codec.from_row(1).identity() == codec.identity()  # the plan's fingerprint knows no chunk


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_kill_in_the_moe_pass_resumes_to_the_same_bytes(merge: tuple[Path, Path], computed: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    """The run killed (SIGKILL, a real process) once the pass's first layer (its experts' sums and counts) is
    durable, run again, resumes at the second layer and writes the bytes of a run never killed."""
    config, texts = merge
    whole, matrix = computed
    out, state = tmp_path / "out", tmp_path / "s"
    args = ("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts)
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_imatrix_layer:1"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (folder,) = (p for p in (state / "imatrix").iterdir() if p.is_dir())
    (layer,) = folder.glob("*/layer-*.safetensors")
    from safetensors import safe_open

    with safe_open(str(layer), framework="pt") as journal:
        assert "imatrix-counts:model.layers.0.mlp.experts" in set(journal.keys())
    again = cli(*args, timeout=300)
    assert again.returncode == 0, again.stderr
    (resumed,) = (state / "imatrix").glob("*.gguf")
    assert _sha(resumed) == _sha(matrix)
    assert _sha(out / "model.gguf") == _sha(whole / "model.gguf")


def test_measure_writes_the_moe_matrix_the_route_computes(merge: tuple[Path, Path], computed: tuple[Path, Path],
                                                          written: Path, tmp_path: Path) -> None:
    """``measure --imatrix`` of the written MoE merge (refused before: a mixture of experts has no Grams of its
    experts) sums each expert's routed inputs with a count per expert, as the run's pass over the merge never
    written does: the same entries, the same per-expert counts, the raw sums equal to float rounding; ``--imatrix
    OUT.dat`` writes the older form of the same matrix."""
    _, texts = merge
    _, matrix = computed
    done, measured = dense.measured_matrix(written, texts, tmp_path)
    ours = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(measured).tensors}
    route = {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(matrix).tensors}
    assert sorted(ours) == sorted(route)
    assert any(name.endswith("_exps.weight.counts") for name in ours)
    for name, want in route.items():
        if name.endswith(".counts"):
            assert np.array_equal(ours[name], want), name
        else:
            assert ours[name].shape == want.shape and np.allclose(ours[name], want, rtol=1e-4, atol=1e-6), name
    assert f"{len(read_imatrix(matrix))} weight(s) in {measured}" in done.stdout
    # by its extension, the older .dat form of the same measurement (found measured), read back alike
    older = tmp_path / "measured.dat"
    again = cli("measure", tmp_path / "one.yml", tmp_path / "grams", "--texts", texts, "--state-dir", tmp_path / "s",
                "--imatrix", older)
    assert again.returncode == 0 and "already measured" in again.stdout, again.stderr
    assert not older.read_bytes().startswith(b"GGUF")
    dat, full = read_imatrix(older), read_imatrix(measured)
    assert sorted(dat) == sorted(full)
    for name, values in full.items():
        assert np.allclose(dat[name], values, rtol=1e-6, atol=0), name
