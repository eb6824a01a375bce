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
from resumerge.merge.plan.gguftypes import ModelFacts, TypeChoices, parse_tensor_types, tensor_type
from resumerge.outputs.gguf.outcodec import GgufOutCodec

F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 30, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
LLAMA_7B = ModelFacts(layers=32, gqa=1)
MIXTRAL = ModelFacts(layers=32, gqa=4, experts=8)
QWEN3_MOE = ModelFacts(layers=48, gqa=8, experts=128)
TIED = ModelFacts(tied=True, layers=30, gqa=3)

# (GGUF name, HF shape, --gguf-type, model) -> (llama.cpp's type, the type resumerge writes)
TABLE = [
    # every other matrix: the file's type (no imatrix: ffn_down keeps it too)
    ("blk.0.attn_q.weight", (4096, 4096), "q4_0", LLAMA_7B, Q4_0, Q4_0),
    ("blk.0.ffn_down.weight", (4096, 11008), "q4_0", LLAMA_7B, Q4_0, Q4_0),
    ("blk.0.ffn_up.weight", (11008, 4096), "q5_1", LLAMA_7B, Q5_1, Q5_1),
    # the head: Q6_K in a 4- or 5-bit file, Q8_0 in a Q8_0 file, the file's type in a float file
    ("output.weight", (32000, 4096), "q4_0", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q4_1", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q5_0", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q5_1", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q4_k_m", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q2_k", LLAMA_7B, Q6_K, Q6_K),
    ("output.weight", (32000, 4096), "q8_0", LLAMA_7B, Q8_0, Q8_0),
    ("output.weight", (32000, 4096), "f16", LLAMA_7B, F16, F16),
    ("output.weight", (32000, 4096), "bf16", LLAMA_7B, BF16, BF16),
    # ... whose rows are not whole blocks of the default type (SmolLM2's 576): Q8_0
    ("output.weight", (49152, 576), "q4_1", LLAMA_7B, Q8_0, Q8_0),
    ("output.weight", (49152, 576), "q4_k_m", LLAMA_7B, Q8_0, Q8_0),
    # a tied embedding is the head; an untied one keeps the file's type
    ("token_embd.weight", (49152, 576), "q4_1", TIED, Q8_0, Q8_0),
    ("token_embd.weight", (151936, 1536), "q4_0", TIED, Q6_K, Q6_K),
    ("token_embd.weight", (32000, 4096), "q4_0", LLAMA_7B, Q4_0, Q4_0),
    ("token_embd.weight", (32000, 4096), "q4_k_m", LLAMA_7B, Q4_K, Q4_K),
    # exactly 8 experts (Mixtral): attn_v and attn_k Q8_0; other expert counts nothing
    ("blk.3.attn_v.weight", (1024, 4096), "q4_0", MIXTRAL, Q8_0, Q8_0),
    ("blk.3.attn_k.weight", (1024, 4096), "q5_0", MIXTRAL, Q8_0, Q8_0),
    ("blk.3.attn_q.weight", (4096, 4096), "q4_0", MIXTRAL, Q4_0, Q4_0),
    ("blk.3.attn_output.weight", (4096, 4096), "q4_k_m", MIXTRAL, Q5_K, Q5_K),
    ("blk.3.ffn_down_exps.weight", (8, 4096, 14336), "q4_0", MIXTRAL, Q4_0, Q4_0),
    ("blk.3.attn_v.weight", (512, 2048), "q4_0", QWEN3_MOE, Q4_0, Q4_0),
    # the K mixes' bumps: attn_v and ffn_down in use_more_bits layers (n=32: 0-3, 6, 9, ..., 27, 28-31)
    ("blk.0.attn_v.weight", (1024, 4096), "q4_k_m", LLAMA_7B, Q6_K, Q6_K),
    ("blk.4.attn_v.weight", (1024, 4096), "q4_k_m", LLAMA_7B, Q4_K, Q4_K),
    ("blk.6.ffn_down.weight", (4096, 11008), "q5_k_m", LLAMA_7B, Q6_K, Q6_K),
    ("blk.7.ffn_down.weight", (4096, 11008), "q5_k_m", LLAMA_7B, Q5_K, Q5_K),
    ("blk.3.attn_v.weight", (1024, 4096), "q4_k_s", LLAMA_7B, Q5_K, Q5_K),
    ("blk.4.attn_v.weight", (1024, 4096), "q4_k_s", LLAMA_7B, Q4_K, Q4_K),
    ("blk.1.attn_v.weight", (1024, 4096), "q3_k_m", LLAMA_7B, Q5_K, Q5_K),
    ("blk.2.attn_v.weight", (1024, 4096), "q3_k_m", LLAMA_7B, Q4_K, Q4_K),
    ("blk.1.ffn_down.weight", (4096, 11008), "q3_k_m", LLAMA_7B, Q5_K, Q5_K),
    ("blk.2.ffn_down.weight", (4096, 11008), "q3_k_m", LLAMA_7B, Q4_K, Q4_K),
    ("blk.9.attn_output.weight", (4096, 4096), "q3_k_l", LLAMA_7B, Q5_K, Q5_K),
    ("blk.9.attn_output.weight", (4096, 4096), "q2_k", LLAMA_7B, Q3_K, Q3_K),
    ("blk.9.attn_v.weight", (1024, 4096), "q2_k", LLAMA_7B, Q3_K, Q3_K),
    ("blk.9.attn_v.weight", (512, 4096), "q2_k", MIXTRAL, Q8_0, Q8_0),
    ("blk.9.attn_v.weight", (512, 4096), "q2_k", ModelFacts(layers=32, gqa=4), Q4_K, Q4_K),
    ("blk.9.attn_v.weight", (1024, 8192), "q3_k_s", ModelFacts(layers=80, gqa=8, is_70b=True), Q5_K, Q5_K),
    ("blk.5.ffn_down_exps.weight", (128, 2048, 768), "q4_k_m", QWEN3_MOE, Q6_K, Q6_K),
    ("blk.9.ffn_down_exps.weight", (128, 2048, 768), "q4_k_m", QWEN3_MOE, Q4_K, Q4_K),
    # rows that are not whole 256-value blocks: the K types fall back, to F16 past 32-value blocks too
    ("blk.0.ffn_down.weight", (576, 288), "q4_k_m", TIED, Q8_0, Q8_0),
    ("blk.4.ffn_down.weight", (576, 288), "q4_k_m", TIED, Q5_0, Q5_0),
    ("blk.1.ffn_down.weight", (576, 288), "q5_k_s", TIED, Q5_1, Q5_1),
    ("blk.1.ffn_down.weight", (576, 288), "q3_k_s", TIED, Q4_0, Q4_0),
    ("blk.1.ffn_down.weight", (576, 296), "q3_k_s", TIED, F16, F16),
    # never quantized: 1-D tensors, norms, routers
    ("blk.0.attn_norm.weight", (4096,), "q4_0", LLAMA_7B, F32, F32),
    ("blk.0.attn_q_norm.weight", (128,), "q4_k_m", LLAMA_7B, F32, F32),
    ("blk.0.ffn_gate_inp.weight", (8, 4096), "q4_0", MIXTRAL, F32, F32),
    ("blk.0.attn_q.bias", (4096,), "q8_0", LLAMA_7B, F32, F32),
    # rows that are not whole 32-value blocks: llama.cpp refuses the tensor in a legacy type; resumerge writes F16
    ("blk.0.attn_q.weight", (64, 40), "q4_0", LLAMA_7B, Q4_0, F16),
]


@pytest.mark.parametrize(("name", "shape", "mix", "model", "llama", "written"), TABLE)
def test_each_tensor_gets_the_type_llama_cpp_s_quantizer_picks(name: str, shape: tuple[int, ...], mix: str,
                                                               model: ModelFacts, llama: int, written: int) -> None:
    chosen = tensor_type(name, shape, mix, model)
    assert (chosen.llama, chosen.written) == (llama, written)


def test_the_type_overrides_follow_llama_quantize_s() -> None:
    """--gguf-tensor-type: the first pattern that matches wins, one naming the mix's default too (the mix's bumps
    then not applied: attn_v of a use_more_bits layer stays Q4_K; tests/test_gguf_kquants.py checks it against
    llama-quantize), then the row fallback; --gguf-output-type and --gguf-token-embedding-type win outright,
    without it; a tied embedding takes the output type."""
    pairs = parse_tensor_types(["attn_v=q4_k", "ATTN_=Q8_0", "ffn_down=q6_k"])
    chosen = TypeChoices(pairs, output=Q5_K, token_embedding=Q3_K)
    assert tensor_type("blk.0.attn_v.weight", (1024, 4096), "q4_k_m", LLAMA_7B, chosen).llama == Q4_K
    assert tensor_type("blk.0.attn_v.weight", (1024, 4096), "q4_k_m", LLAMA_7B).llama == Q6_K
    assert tensor_type("blk.0.attn_q.weight", (4096, 4096), "q4_k_m", LLAMA_7B, chosen).llama == Q8_0
    assert tensor_type("blk.0.ffn_down.weight", (4096, 576), "q4_k_m", LLAMA_7B, chosen).llama == Q8_0
    assert tensor_type("output.weight", (32000, 576), "q4_k_m", LLAMA_7B, chosen).llama == Q5_K
    assert tensor_type("token_embd.weight", (32000, 576), "q4_k_m", LLAMA_7B, chosen).llama == Q3_K
    assert tensor_type("token_embd.weight", (32000, 576), "q4_k_m", TIED,
                       TypeChoices(output=Q5_K)).llama == Q5_1  # the output type, then the row fallback
    with pytest.raises(ValueError, match="PATTERN=TYPE"):
        parse_tensor_types(["attn_v"])
    with pytest.raises(ValueError, match="not a regular expression"):
        parse_tensor_types(["attn_v(=q4_k"])


def _parents(root: Path) -> Path:
    for name, seed in (("a", 1), ("b", 2)):
        write_gguf(root / f"{name}.gguf", "llama", to_gguf("llama", hf_tensors("llama", seed=seed)), Q.F32)
    return write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(root / "a.gguf"), "parameters": {"weight": 0.3}},
        {"model": str(root / "b.gguf"), "parameters": {"weight": 0.7}}]})


def test_a_q4_0_output_writes_its_head_q6_k_and_the_plan_names_its_size(tmp_path: Path) -> None:
    """The head (rows of 256 values) gets Q6_K from llama.cpp, which resumerge now encodes (it wrote Q8_0 before
    it had the K-quants); every other matrix is Q4_0; the plan's notes (the log, status and the card) give the
    file's tensor bytes and bits per weight."""
    config = _parents(tmp_path)
    plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type="q4_0")))
    codecs = {tp.out_codec.gguf_name: tp.out_codec for tp in plan.tensors.values()
              if isinstance(tp.out_codec, GgufOutCodec)}
    assert codecs["output.weight"].ggml_type == Q6_K and codecs["output.weight"].llama_type == -1
    assert codecs["blk.0.attn_q.weight"].ggml_type == Q4_0 and codecs["blk.0.attn_q.weight"].llama_type == -1
    assert not any(n.startswith("GGUF types:") for n in plan.notes)
    note = next(n for n in plan.notes if n.startswith("GGUF size:"))
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(out_type="gguf",
                                                                                           gguf_type="q4_0")))
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_0
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    values = sum(int(t.n_elements) for t in reader.tensors)
    assert f"{8 * stored / values:.2f} bits per weight" in note and "Q4_0 15, F32 5, Q6_K 1" in note, note
    assert note in (out / "README.md").read_text()


def test_a_gguf_outputs_card_gives_its_file_types_kl_from_the_float_merge(tmp_path: Path) -> None:
    """The card of a GGUF output said which types it holds, not what they cost (issue 71: "with the KL in the
    card"): it quotes its file type's KL from the float32 merge, as resumerge's check measured it on a real merge
    (bench/bench_gguf_kl.py), for every single type ``--gguf-type`` takes but Q4_1 (the reference's weights are
    Q4_1's own: no figure for it says anything; the K-quant mixes: the next test; the ternary and MXFP4_MOE mixes
    have none: on the reference merge every ternary matrix falls back to Q4_0, and a dense model's MXFP4_MOE is all
    Q8_0); a safetensors output's card has no such line."""
    from resumerge.merge.plan.defaults import GGUF_TYPES
    from resumerge.merge.plan.modelcard import render_model_card
    from resumerge.outputs.gguf.quality import QUALITY

    def single(kind: str) -> bool:  # a type, not a mix (those: the next test)
        return "_k" not in kind and not kind.startswith(("iq", "tq", "mxfp4"))

    assert {t for t in QUALITY if single(t)} == {t for t in GGUF_TYPES if single(t)} - {"q4_1"}
    for order in (("f16", "q8_0", "q5_0", "q4_0"), ("bf16", "q8_0", "q5_1", "q4_0")):  # fewer bits, more lost
        assert [QUALITY[t].kl for t in order] == sorted(QUALITY[t].kl for t in order)
    config = _parents(tmp_path)
    text = config.read_text()
    for kind in ("q4_0", "q8_0"):
        plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_type="gguf", gguf_type=kind)))
        card = render_model_card(plan, text).decode()
        line = next(x for x in card.splitlines() if x.startswith("Quantization:"))
        assert f"written as {kind.upper()} is KL {QUALITY[kind].kl:.4f} from its float32 merge" in line, line
        assert f"{QUALITY[kind].top1:.1%}" in line and "SmolLM2-135M" in line
    q4_1 = render_model_card(api.plan_merge(config, settings=api.Settings(
        output=api.Output(out_type="gguf", gguf_type="q4_1"))), text)
    assert b"## GGUF" in q4_1 and b"Quantization:" not in q4_1
    plain = render_model_card(api.plan_merge(config), text).decode()
    assert "Quantization:" not in plain and "## GGUF" not in plain


def test_a_k_quant_outputs_card_gives_its_mixs_kl_with_and_without_the_importance_matrix(tmp_path: Path) -> None:
    """Issue 84: the card of a K-quant output quotes, for its mix, the KL from the float32 merge and the top-1
    agreement resumerge's check measured on the real reference merge (bench/bench_gguf_kl.py), without an importance
    matrix and with the one computed on the merge, and says which of the two this file is; the matrix lowered KL at
    every mix measured. So does an IQ4 mix's (issue 95); Q2_K_S, written only with a matrix, has no figure."""
    from resumerge.merge.plan.defaults import GGUF_TYPES
    from resumerge.merge.plan.gguftypes import MIXES
    from resumerge.merge.plan.modelcard import render_model_card
    from resumerge.outputs.gguf.quality import QUALITY

    measured = {kind: q for kind, q in QUALITY.items() if "_k" in kind or kind.startswith("iq")}
    assert set(measured) == {t for t in GGUF_TYPES if ("_k" in t or t.startswith("iq")) and not MIXES[t].needs_imatrix}
    for q in measured.values():
        assert q.kl_imatrix is not None and q.top1_imatrix is not None and q.kl_imatrix < q.kl
    config = _parents(tmp_path)
    text = config.read_text()
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat.\n")
    for kind, q in measured.items():
        for output, said in ((api.Output(out_type="gguf", gguf_type=kind), "without"),
                             (api.Output(out_type="gguf", gguf_type=kind, imatrix_texts=texts), "with")):
            card = render_model_card(api.plan_merge(config, settings=api.Settings(output=output)), text).decode()
            line = next(x for x in card.splitlines() if x.startswith("Quantization:"))
            assert (f"written as {kind.upper()} is KL {q.kl:.4f} from its float32 merge without an importance "
                    f"matrix (the most likely next token the same at {q.top1:.1%} of positions) and KL "
                    f"{q.kl_imatrix:.4f} with one computed on the merge") in line, line
            assert f"({q.top1_imatrix:.1%};" in line and f"this file was written {said} one" in line, line
