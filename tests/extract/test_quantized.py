"""LoRA extraction from a quantized BASE and fine-tune: their tensors are decoded through the run's codecs before
the task vector is taken, so the adapter is the one extracted from the decoded (dequantized) pair."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toycodec import TOY, RowScaledInt8, assert_same_results, twins

from resumerge.inputs.codecs import CodecTable
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.runs.extract.planner import build_extraction_plan, open_pair
from resumerge.runs.extract.spec import ExtractSpec


def _pair(root: Path, base: Path, ft: Path) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    """(quantized BASE, FT) and (the same pair stored plainly as decoded), under ``root``."""
    quantized, plain = (root / "q-base", root / "q-ft"), (root / "p-base", root / "p-ft")
    for source, q, p in zip((base, ft), quantized, plain):
        twins(source, q, p)
    return quantized, plain


def _plan(base: Path, ft: Path, codecs: CodecTable) -> Plan:
    spec = ExtractSpec(model=str(ft), base_model=str(base), max_rank=4, exact=True)
    inputs, ft_key, base_key = open_pair(spec)
    return build_extraction_plan(spec, inputs, ft_key, base_key, PlanOptions(), codecs)


def test_an_adapter_from_a_quantized_pair_is_the_one_from_its_decoded_pair(
        pair: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    quantized, plain = _pair(tmp_path, *pair("llama"))
    from_codes, from_values = _plan(*quantized, TOY), _plan(*plain, CodecTable())
    assert from_codes.tensors.keys() == from_values.tensors.keys()
    decoded = [tp for tp in from_codes.tensors.values() if any(r.codec == RowScaledInt8() for r in tp.inputs)]
    assert decoded and all(r.companions for tp in decoded for r in tp.inputs)
    assert_same_results(from_codes, from_values)
