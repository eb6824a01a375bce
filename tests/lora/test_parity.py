"""apply_lora against PEFT's merge_and_unload (the oracle mergekit uses), by hand, and across row chunkings."""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load_file

from lora.conftest import CASES, Case
from lora.gen import merge_with_adapter, read_source
from resumerge.inputs.adapters import apply_lora, apply_lora_rows, open_adapter
from resumerge.inputs.tensorio import TensorReader


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_tensor_matches_peft_merge_and_unload(name: str, lora_case: Callable[[str], Case]) -> None:
    case = lora_case(name)
    adapter = open_adapter(case.adapter, yaml_path="models[0]")
    ours = merge_with_adapter(case.base, adapter)
    base = {}
    for path in case.base.glob("*.safetensors"):
        base.update(load_file(str(path)))
    assert set(ours) == set(base)
    assert adapter.targets, "the case must adapt something"
    for tensor, merged in ours.items():
        expected = case.oracle[tensor]
        assert merged.dtype == expected.dtype == base[tensor].dtype, tensor
        if merged.dtype == torch.float32:
            assert torch.allclose(merged, expected, rtol=0, atol=1e-5), tensor
        else:
            assert torch.equal(merged.view(torch.int16), expected.view(torch.int16)), f"{tensor}: bits differ"
        changed = not torch.equal(merged, base[tensor])
        # Not vacuous: exactly the targets and replacements change, everything else is the base's.
        assert changed == (tensor in adapter.targets or tensor in adapter.replacements), tensor


@pytest.mark.parametrize("name", ["llama-bf16-rslora", "gpt2-f32-bias", "llama-f32"])
def test_row_chunks_are_bit_identical_to_the_whole(name: str, lora_case: Callable[[str], Case]) -> None:
    case = lora_case(name)
    adapter = open_adapter(case.adapter, yaml_path="models[0]")
    base = {}
    for path in case.base.glob("*.safetensors"):
        base.update(load_file(str(path)))
    rng = random.Random(0)
    reader = TensorReader()
    try:
        for tensor, t in adapter.targets.items():
            a, b = read_source(reader, adapter.directory, t.a), read_source(reader, adapter.directory, t.b)
            weight = base[tensor]
            whole = apply_lora(weight, a, b, t.scale, t.fan_in_fan_out, embedding=t.embedding)
            for sizes in ([1] * weight.shape[0], _random_split(weight.shape[0], rng)):
                parts, first = [], 0
                for size in sizes:
                    parts.append(apply_lora_rows(weight[first:first + size], a, b, t.scale, t.fan_in_fan_out,
                                                 first_row=first, embedding=t.embedding))
                    first += size
                assert torch.equal(torch.cat(parts), whole), tensor
    finally:
        reader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_chunking_invariance_on_wide_tensors(dtype: torch.dtype, fan_in_fan_out: bool) -> None:
    # Rows wider than one internal tile (16 384 elements) and ranks above 16: tile borders fall mid-row.
    gen = torch.Generator().manual_seed(1)
    rows, cols, rank = 7, 17_000, 17
    weight = torch.randn(rows, cols, generator=gen).to(dtype)
    a = torch.randn(rank, rows if fan_in_fan_out else cols, generator=gen)
    b = torch.randn(cols if fan_in_fan_out else rows, rank, generator=gen)
    whole = apply_lora(weight, a, b, 0.37, fan_in_fan_out)
    assert whole.dtype == dtype and not torch.equal(whole, weight)
    for split in ([3, 4], [1, 5, 1], [7]):
        parts, first = [], 0
        for size in split:
            parts.append(apply_lora_rows(weight[first:first + size], a, b, 0.37, fan_in_fan_out, first_row=first))
            first += size
        assert torch.equal(torch.cat(parts), whole)
    product = b.double() @ a.double()
    reference = weight.double() + 0.37 * (product.T if fan_in_fan_out else product)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float64: 1e-12}[dtype]
    assert torch.allclose(whole.double(), reference, rtol=tolerance, atol=tolerance)


def test_hand_computed_linear_and_fan_in_fan_out() -> None:
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = torch.tensor([[1.0, 0.0]])  # (r=1, in=2)
    b = torch.tensor([[2.0], [1.0]])  # (out=2, r=1): B @ A = [[2, 0], [1, 0]]
    assert apply_lora(weight, a, b, 0.5, False).tolist() == [[2.0, 2.0], [3.5, 4.0]]
    conv = torch.zeros(2, 3)  # GPT-2 Conv1D stores (in=2, out=3); B @ A is (3, 2) and is transposed
    a2 = torch.tensor([[1.0, 2.0]])
    b2 = torch.tensor([[1.0], [10.0], [100.0]])
    assert apply_lora(conv, a2, b2, 1.0, True).tolist() == [[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]]
    assert apply_lora_rows(conv[1:], a2, b2, 1.0, True, first_row=1).tolist() == [[2.0, 20.0, 200.0]]


def test_embedding_rounds_the_delta_before_adding_and_linear_does_not() -> None:
    # Delta 2^-8 + 2^-20 on a bf16 1.0 (spacing 2^-7). Linear: 1 + 2^-8 + 2^-20 is past the midpoint, so it
    # rounds up. Embedding (PEFT: W += delta.to(W.dtype)): the delta first rounds to 2^-8, then 1 + 2^-8 is a
    # tie that rounds to even, 1.0.
    weight = torch.ones(1, 1, dtype=torch.bfloat16)
    a = torch.ones(1, 1)
    b = torch.tensor([[2.0**-8 + 2.0**-20]])
    assert apply_lora(weight, a, b, 1.0, False).item() == 1.0078125
    assert apply_lora(weight, a, b, 1.0, True, embedding=True).item() == 1.0


def test_product_is_the_sequential_fused_multiply_add_chain() -> None:
    # fma(b1, a1, fma(b0, a0, 0)) with every step rounded once, computed exactly with fractions. Here the naive
    # "round each product, then add" gives 0 while the FMA chain keeps -2^-24 + 2^-36.
    u, v = 2.0**-12 + 2.0**-18, 2.0**-12 - 2.0**-18
    b = torch.tensor([[1.0 + 2.0**-12, -(1.0 + u)]])
    a = torch.tensor([[1.0 + 2.0**-12], [1.0 + v]])
    got = apply_lora(torch.zeros(1, 1), a, b, 1.0, False).item()
    assert got == -(2.0**-24) + 2.0**-36
    gen = torch.Generator().manual_seed(3)
    for rank in (1, 5, 17):
        a = torch.randn(rank, 6, generator=gen)
        b = torch.randn(5, rank, generator=gen)
        got_matrix = apply_lora(torch.zeros(5, 6), a, b, 1.0, False)
        for i in range(5):
            for j in range(6):
                acc = 0.0
                for k in range(rank):
                    acc = _round_f32(Fraction(acc) + Fraction(b[i, k].item()) * Fraction(a[k, j].item()))
                assert got_matrix[i, j].item() == acc, (rank, i, j)


def test_factors_in_any_float_dtype_are_used_as_float32() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(20, 24, generator=gen).to(torch.bfloat16)
    a = torch.randn(3, 24, generator=gen).to(torch.bfloat16)
    b = torch.randn(20, 3, generator=gen).to(torch.float16)
    assert torch.equal(apply_lora(weight, a, b, 2.0, False), apply_lora(weight, a.float(), b.float(), 2.0, False))


@pytest.mark.parametrize(
    "weight, a, b, fan_in_fan_out, first_row, embedding",
    [
        ((4, 5), (2, 5), (4, 3), False, 0, False),  # ranks differ
        ((4, 6), (2, 5), (4, 2), False, 0, False),  # columns do not fit
        ((4, 5), (2, 5), (4, 2), False, 1, False),  # rows past the end
        ((5, 4), (2, 5), (4, 2), False, 0, True),  # embedding without fan_in_fan_out
        ((4, 5), (0, 5), (4, 0), False, 0, False),  # rank 0
    ],
)
def test_misfit_shapes_raise_value_error(
    weight: tuple[int, int], a: tuple[int, int], b: tuple[int, int], fan_in_fan_out: bool, first_row: int,
    embedding: bool,
) -> None:
    with pytest.raises(ValueError):
        apply_lora_rows(torch.zeros(weight), torch.zeros(a), torch.zeros(b), 1.0, fan_in_fan_out,
                        first_row=first_row, embedding=embedding)


def _random_split(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n:
        size = min(n, rng.randint(1, 9))
        sizes.append(size)
        n -= size
    return sizes


def _round_f32(q: Fraction) -> float:
    """``q`` rounded to the nearest float32 (ties to even), exactly."""
    if q == 0:
        return 0.0
    sign, q = (-1 if q < 0 else 1), abs(q)
    exponent = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** exponent > q:
        exponent -= 1
    step = Fraction(2) ** max(exponent - 23, -149)
    scaled = q / step
    whole = scaled.numerator // scaled.denominator
    rest = scaled - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    return float(sign * whole * step)
