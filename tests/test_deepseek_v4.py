"""DeepSeek-V4 and Hunyuan v4 (issue 96): a merge keeps the head untied where transformers reads the checkpoint's
``head.weight`` as ``lm_head``; ``check``'s NLL is transformers' own (the hyper-connection streams collapsed by
``hc_head`` before the final norm); the hash-routing tables are copied from the base, never averaged, and parents
whose tables differ are refused at planning; DeepSeek-V4 in its shipped FP4 + FP8 layout is read and written back
in it. Tiny models of tests/deepseek_v4_models.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from deepseek_v4_models import make_v4_model
from support import api_merge, output_tensors

from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

_IDS = torch.Generator().manual_seed(0)
TOKENS = [torch.randint(3, 128, (n,), generator=_IDS).tolist() for n in (30, 17, 9)]


def _load(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


def _linear(tmp_path: Path, a: Path, b: Path) -> Path:
    return api_merge(tmp_path, {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})


def test_a_merge_keeps_the_head_transformers_reads_as_lm_head_untied(tmp_path: Path) -> None:
    # The checkpoint's head is head.weight (transformers' conversion: lm_head.weight); the merge's config said
    # tie_word_embeddings: true, and transformers then loaded the embeddings as the head: another model.
    a, b = make_v4_model(tmp_path / "a", "deepseek_v4", 1), make_v4_model(tmp_path / "b", "deepseek_v4", 2)
    assert "head.weight" in output_tensors(a)
    out = _linear(tmp_path, a, b)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    merged = output_tensors(out)
    assert torch.equal(model.lm_head.weight, merged["head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("family", ["deepseek_v4", "hy_v4"])
def test_check_nll_is_transformers_nll(family: str, tmp_path: Path) -> None:
    # check's pass collapses the hyper-connection streams (hc_head) before the final norm, as the model does
    from newest_check import checked_nll, unpadded_nll

    model = make_v4_model(tmp_path / family, family, 3)
    assert checked_nll(model, TOKENS, tmp_path / "journal") == pytest.approx(unpadded_nll(model, TOKENS), abs=1e-4)


def _ties(tmp_path: Path, base: Path, other: Path) -> Path:
    return api_merge(tmp_path, {"merge_method": "ties", "base_model": str(base), "dtype": "float32",
                                "parameters": {"density": 0.5, "weight": 1.0}, "models": [{"model": str(other)}]})


def _tables(tensors: dict[str, Any]) -> dict[str, Any]:
    return {n: t for n, t in tensors.items() if not t.is_floating_point() and t.dtype != torch.int8}


def test_parents_whose_hash_tables_differ_are_refused_at_planning(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from resumerge.cli.commands import main

    a = make_v4_model(tmp_path / "a", "deepseek_v4", 1)
    b = make_v4_model(tmp_path / "b", "deepseek_v4", 2, tables=1)
    doc = tmp_path / "ties.yml"
    doc.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": str(a), "dtype": "float32",
                                   "parameters": {"density": 0.5, "weight": 1.0}, "models": [{"model": str(b)}]}))
    capsys.readouterr()
    assert main(["plan", str(doc)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "non-float tensor model.layers.0.ffn.gate.tid2eid differs between" in lines[0], lines


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_the_shipped_fp4_fp8_layout_is_merged_in_it(method: str, tmp_path: Path) -> None:
    # DeepSeek-V4-Flash's own layout: FP8 linears in 128x128 blocks and FP4 experts, ue8m0 scales named X.scale,
    # its hash tables I64; the merge is written back in it, each re-quantized weight with fresh scales.
    from deepseek_v4_models import fp4_decode, fp4_encode, make_shipped_v4
    from newest_check import checked_nll, unpadded_nll

    a, b = make_shipped_v4(tmp_path / "a", 1), make_shipped_v4(tmp_path / "b", 2)
    out = _linear(tmp_path / "m", a, b) if method == "linear" else _ties(tmp_path / "m", a, b)
    ta, tb, merged = output_tensors(a), output_tensors(b), output_tensors(out)
    assert {n: (t.dtype, t.shape) for n, t in merged.items()} == {
        n: (t.dtype if not t.is_floating_point() or t.dtype.itemsize == 1 else torch.float32, t.shape)
        for n, t in ta.items()}
    tables = _tables(ta)
    assert tables and all(torch.equal(merged[n], t) for n, t in tables.items())  # the base's, never averaged
    written = json.loads((out / "config.json").read_text())
    assert written["quantization_config"] == json.loads((a / "config.json").read_text())["quantization_config"]
    assert written["tie_word_embeddings"] is False and written["expert_dtype"] == "fp4"
    if method == "linear":
        expert = "layers.1.ffn.experts.2.w2."
        target = 0.5 * fp4_decode(ta[expert + "weight"], ta[expert + "scale"]) + 0.5 * fp4_decode(
            tb[expert + "weight"], tb[expert + "scale"])
        codes, scales = fp4_encode(target)
        assert torch.equal(merged[expert + "scale"], scales)  # fresh: the merged values' own
        decoded = fp4_decode(merged[expert + "weight"], merged[expert + "scale"])
        nearest = (fp4_decode(codes, scales) - target).abs()  # the test's own rounding to the nearest value
        assert bool(((decoded - target).abs() <= nearest + 1e-12).all())  # a tie may round either way
        linear = "layers.1.attn.wq_b."
        want = 0.5 * ta[linear + "weight"].float() * ta[linear + "scale"].float() + 0.5 * tb[
            linear + "weight"].float() * tb[linear + "scale"].float()
        got = merged[linear + "weight"].float() * merged[linear + "scale"].float()
        torch.testing.assert_close(got, want, atol=float(want.abs().max()) / 8, rtol=0)
    model, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert checked_nll(out, TOKENS, tmp_path / "journal") == pytest.approx(unpadded_nll(out, TOKENS), abs=1e-4)


def test_a_stack_of_slices_rewrites_the_shipped_layer_keys(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # deepseek-ai's code and vLLM read compress_ratios and num_hash_layers where transformers reads layer_types and
    # mlp_layer_types: slices a[0, 2) + a[1, 3) make them [0, 4, 4, 128] (+ the MTP layer's 0) and 3 hash layers
    import yaml
    from deepseek_v4_models import make_shipped_v4
    from newest_check import checked_nll, unpadded_nll

    from resumerge.cli.commands import main

    a = make_shipped_v4(tmp_path / "a", 1)
    out = api_merge(tmp_path, {"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(a), "layer_range": [1, 3]}]}]})
    written = json.loads((out / "config.json").read_text())
    assert written["compress_ratios"] == [0, 4, 4, 128, 0] and written["num_hash_layers"] == 3
    ours, theirs = output_tensors(out), output_tensors(a)
    assert torch.equal(ours["layers.2.ffn.gate.tid2eid"], theirs["layers.1.ffn.gate.tid2eid"])
    assert torch.equal(ours["layers.2.ffn.experts.1.w3.weight"], theirs["layers.1.ffn.experts.1.w3.weight"])
    _, info = _load(out)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert checked_nll(out, TOKENS, tmp_path / "journal") == pytest.approx(unpadded_nll(out, TOKENS), abs=1e-4)
    late = tmp_path / "late.yml"
    late.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(a), "layer_range": [2, 4]}]},
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]}]}))
    capsys.readouterr()
    assert main(["plan", str(late)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "is hash-routed but comes after output layer 0" in lines[0], lines


def test_a_dequantized_merge_of_the_shipped_layout_says_nothing_of_fp4(tmp_path: Path) -> None:
    # --dequantize: every weight written plainly, and neither quantization_config nor expert_dtype (vLLM's loader
    # would read fp4 experts) left in config.json
    from deepseek_v4_models import make_shipped_v4
    from newest_check import checked_nll, unpadded_nll

    from resumerge.cli.commands import main

    a, b = make_shipped_v4(tmp_path / "a", 1), make_shipped_v4(tmp_path / "b", 2)
    doc = tmp_path / "linear.yml"
    doc.write_text(json.dumps({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}))
    out = tmp_path / "out"
    assert main(["run", str(doc), str(out), "--dequantize", "--quiet", "--state-dir", str(tmp_path / "s")]) == 0
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and "expert_dtype" not in written
    merged = output_tensors(out)
    assert {t.dtype for t in merged.values()} == {torch.float32, torch.int64}
    assert not any(n.endswith(".scale") for n in merged)
    assert checked_nll(out, TOKENS, tmp_path / "journal") == pytest.approx(unpadded_nll(out, TOKENS), abs=1e-4)
