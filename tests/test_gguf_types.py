"""A GGUF output's tensor types are those llama.cpp's quantizer picks for the file type (issue 71, item 4): a q4_0
output quantized its tied embedding/head to Q4_0 where llama.cpp keeps it at Q8_0 (the published SmolLM2 Q4_1
GGUF does), a KL from the float32 merge of 0.485 against 0.401. The table below is read from llama.cpp's
``src/llama-quant.cpp`` (``tensor_allows_quantization``, ``llama_tensor_get_type_impl``, ``tensor_type_fallback``;
no importance matrix, no overrides), case by case; where llama.cpp picks a type resumerge cannot encode (Q6_K) it
writes Q8_0 and the plan's notes say so."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from support import write_config

from resumerge import api
from resumerge.outputs.gguf.outcodec import GgufOutCodec
from resumerge.plan.gguftypes import tensor_type

F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0 = 0, 1, 30, 2, 3, 6, 7, 14, 8

# (GGUF name, HF shape, file type, tied, experts) -> (llama.cpp's type, the type resumerge writes)
TABLE = [
    # every other matrix: the file's type (no imatrix: ffn_down keeps it too)
    ("blk.0.attn_q.weight", (4096, 4096), Q4_0, False, 0, Q4_0, Q4_0),
    ("blk.0.ffn_down.weight", (4096, 11008), Q4_0, False, 0, Q4_0, Q4_0),
    ("blk.0.ffn_up.weight", (11008, 4096), Q5_1, False, 0, Q5_1, Q5_1),
    # the head: Q6_K in a 4- or 5-bit file (written Q8_0), Q8_0 in a Q8_0 file, the file's type in a float file
    ("output.weight", (32000, 4096), Q4_0, False, 0, Q6_K, Q8_0),
    ("output.weight", (32000, 4096), Q4_1, False, 0, Q6_K, Q8_0),
    ("output.weight", (32000, 4096), Q5_0, False, 0, Q6_K, Q8_0),
    ("output.weight", (32000, 4096), Q5_1, False, 0, Q6_K, Q8_0),
    ("output.weight", (32000, 4096), Q8_0, False, 0, Q8_0, Q8_0),
    ("output.weight", (32000, 4096), F16, False, 0, F16, F16),
    ("output.weight", (32000, 4096), BF16, False, 0, BF16, BF16),
    # ... whose rows are not whole 256-value blocks (SmolLM2's 576): Q6_K falls back to Q8_0
    ("output.weight", (49152, 576), Q4_1, False, 0, Q8_0, Q8_0),
    # a tied embedding is the head; an untied one keeps the file's type
    ("token_embd.weight", (49152, 576), Q4_1, True, 0, Q8_0, Q8_0),
    ("token_embd.weight", (151936, 1536), Q4_0, True, 0, Q6_K, Q8_0),
    ("token_embd.weight", (32000, 4096), Q4_0, False, 0, Q4_0, Q4_0),
    # exactly 8 experts (Mixtral): attn_v and attn_k Q8_0, the rest the file's type; other expert counts nothing
    ("blk.3.attn_v.weight", (1024, 4096), Q4_0, False, 8, Q8_0, Q8_0),
    ("blk.3.attn_k.weight", (1024, 4096), Q5_0, False, 8, Q8_0, Q8_0),
    ("blk.3.attn_q.weight", (4096, 4096), Q4_0, False, 8, Q4_0, Q4_0),
    ("blk.3.ffn_down_exps.weight", (8, 4096, 14336), Q4_0, False, 8, Q4_0, Q4_0),
    ("blk.3.attn_v.weight", (512, 2048), Q4_0, False, 128, Q4_0, Q4_0),
    # never quantized: 1-D tensors, norms, routers
    ("blk.0.attn_norm.weight", (4096,), Q4_0, False, 0, F32, F32),
    ("blk.0.attn_q_norm.weight", (128,), Q4_0, False, 0, F32, F32),
    ("blk.0.ffn_gate_inp.weight", (8, 4096), Q4_0, False, 8, F32, F32),
    ("blk.0.attn_q.bias", (4096,), Q8_0, False, 0, F32, F32),
    # rows that are not whole 32-value blocks: llama.cpp refuses the tensor; resumerge writes F16
    ("blk.0.attn_q.weight", (64, 40), Q4_0, False, 0, Q4_0, F16),
]


@pytest.mark.parametrize(("name", "shape", "file_type", "tied", "experts", "llama", "written"), TABLE)
def test_each_tensor_gets_the_type_llama_cpp_s_quantizer_picks(name: str, shape: tuple[int, ...], file_type: int,
                                                               tied: bool, experts: int, llama: int,
                                                               written: int) -> None:
    chosen = tensor_type(name, shape, file_type, tied=tied, experts=experts)
    assert (chosen.llama, chosen.written) == (llama, written)


def _parents(root: Path) -> Path:
    for name, seed in (("a", 1), ("b", 2)):
        write_gguf(root / f"{name}.gguf", "llama", to_gguf("llama", hf_tensors("llama", seed=seed)), Q.F32)
    return write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(root / "a.gguf"), "parameters": {"weight": 0.3}},
        {"model": str(root / "b.gguf"), "parameters": {"weight": 0.7}}]})


def test_a_q4_0_output_writes_its_head_q8_0_and_says_llama_cpp_would_write_q6_k(tmp_path: Path) -> None:
    """The head (rows of 256 values) gets Q6_K from llama.cpp, which resumerge cannot encode: Q8_0, and the plan's
    notes (the log, status and the card) say so; every other matrix is Q4_0."""
    config = _parents(tmp_path)
    plan = api.plan_merge(config, output=api.Output(out_type="gguf", gguf_type="q4_0"))
    codecs = {tp.out_codec.gguf_name: tp.out_codec for tp in plan.tensors.values()
              if isinstance(tp.out_codec, GgufOutCodec)}
    assert codecs["output.weight"].ggml_type == Q8_0 and codecs["output.weight"].llama_type == Q6_K
    assert codecs["blk.0.attn_q.weight"].ggml_type == Q4_0 and codecs["blk.0.attn_q.weight"].llama_type == -1
    note = next(n for n in plan.notes if n.startswith("GGUF types:"))
    assert "output.weight Q6_K" in note and "no encoder" in note and note.endswith(": Q8_0"), note
    out = tmp_path / "out"
    api.run(config, out, state_dir=tmp_path / "s", output=api.Output(out_type="gguf", gguf_type="q4_0"))
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert types["output.weight"] == Q.Q8_0 and types["token_embd.weight"] == Q.Q4_0
    assert note in (out / "README.md").read_text()


def test_a_gguf_outputs_card_gives_its_file_types_kl_from_the_float_merge(tmp_path: Path) -> None:
    """The card of a GGUF output said which types it holds, not what they cost (issue 71: "with the KL in the
    card"): it quotes its file type's KL from the float32 merge, as resumerge's check measured it on a real merge
    (bench/bench_gguf_kl.py), for every type ``--gguf-type`` takes but Q4_1 (the reference's weights are Q4_1's
    own: no figure for it says anything); a safetensors output's card has no such line."""
    from resumerge.outputs.gguf.quality import QUALITY
    from resumerge.plan.defaults import GGUF_TYPES
    from resumerge.plan.modelcard import render_model_card

    assert set(QUALITY) == set(GGUF_TYPES) - {"q4_1"}
    for order in (("f16", "q8_0", "q5_0", "q4_0"), ("bf16", "q8_0", "q5_1", "q4_0")):  # fewer bits, more lost
        assert [QUALITY[t].kl for t in order] == sorted(QUALITY[t].kl for t in order)
    config = _parents(tmp_path)
    text = config.read_text()
    for kind in ("q4_0", "q8_0"):
        plan = api.plan_merge(config, output=api.Output(out_type="gguf", gguf_type=kind))
        card = render_model_card(plan, text).decode()
        line = next(x for x in card.splitlines() if x.startswith("Quantization:"))
        assert f"written as {kind.upper()} is KL {QUALITY[kind].kl:.4f} from its float32 merge" in line, line
        assert f"{QUALITY[kind].top1:.1%}" in line and "SmolLM2-135M" in line
    q4_1 = render_model_card(api.plan_merge(config, output=api.Output(out_type="gguf", gguf_type="q4_1")), text)
    assert b"## GGUF" in q4_1 and b"Quantization:" not in q4_1
    plain = render_model_card(api.plan_merge(config), text).decode()
    assert "Quantization:" not in plain and "## GGUF" not in plain
