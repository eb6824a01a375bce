"""``--gguf-target-size``'s choice (``resumerge.merge.plan.ggufbudget``) on cases checked by hand: the knapsack
takes the upgrade that saves the most cost per byte while it fits, never an option dominated by a smaller one, fills
what the hull's steps leave, breaks ties by name; and the costs the importance pass measures
(``resumerge.outputs.gguf.sensitivity``) fall as a type holds more bits, and weigh each column by its importance."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from resumerge.analyses.importance.sums import Rerun, SumStep, carried
from resumerge.forward.job.layerpass import unreserved
from resumerge.inputs.gguf import ggmltypes as ggml
from resumerge.machine.torch_import import torch
from resumerge.merge.plan.ggufbudget import Option, choose, chosen_pairs, chosen_patterns, chosen_tensor
from resumerge.outputs.gguf.sensitivity import candidate_types, quantization_costs, type_bytes

SMALL, LARGE, LARGEST = 1, 2, 3  # stand-in type ids: only their order and identity matter to choose()

A = [Option(SMALL, 10, 8.0), Option(LARGE, 20, 2.0)]  # upgrading saves 0.6 a byte
B = [Option(SMALL, 10, 4.0), Option(LARGE, 20, 3.0)]  # upgrading saves 0.1 a byte


@pytest.mark.parametrize(("budget", "expected"), [
    (19, None),  # the smallest of each, 20 bytes, does not fit
    (20, {"a": SMALL, "b": SMALL}),
    (29, {"a": SMALL, "b": SMALL}),  # no upgrade (10 bytes) fits in 9
    (30, {"a": LARGE, "b": SMALL}),  # a's upgrade saves 6 for 10 bytes, b's 1: a's first
    (40, {"a": LARGE, "b": LARGE}),
])
def test_the_upgrade_saving_most_a_byte_comes_first(budget: int, expected: dict[str, int] | None) -> None:
    assert choose({"a": A, "b": B}, budget) == expected


def test_an_option_dominated_by_a_smaller_one_is_never_chosen() -> None:
    """c's middle option costs more than its smallest: with room for it alone it stays at the smallest, with room
    for the largest it takes that."""
    c = [Option(SMALL, 10, 5.0), Option(LARGE, 15, 6.0), Option(LARGEST, 20, 1.0)]
    assert choose({"c": c}, 15) == {"c": SMALL}
    assert choose({"c": c}, 20) == {"c": LARGEST}


def test_a_step_off_the_hull_fills_what_the_hull_steps_leave() -> None:
    """d's middle option is off its convex hull (0.25 a byte, against 1.0 a byte straight to the largest): with
    12 bytes the hull's step (10 more) does not fit, and the fill takes the middle one (2 more, saves 0.5)."""
    d = [Option(SMALL, 10, 10.0), Option(LARGE, 12, 9.5), Option(LARGEST, 20, 0.0)]
    assert choose({"d": d}, 12) == {"d": LARGE}
    assert choose({"d": d}, 20) == {"d": LARGEST}
    # with e beside it (its step: 5 bytes, 1.0 a byte): in 17 bytes only d's middle step fits (15 + 2), in 20
    # e's step fits and d's then does not (20 + 2)
    e = [Option(SMALL, 5, 5.0), Option(LARGE, 10, 0.0)]
    assert choose({"d": d, "e": e}, 17) == {"d": LARGE, "e": SMALL}
    assert choose({"d": d, "e": e}, 20) == {"d": SMALL, "e": LARGE}


def test_ties_go_by_name_whatever_the_order_given() -> None:
    same = [Option(SMALL, 10, 5.0), Option(LARGE, 20, 0.0)]
    assert choose({"b": same, "a": same}, 30) == {"a": LARGE, "b": SMALL}
    assert choose({"a": same, "b": same}, 30) == {"a": LARGE, "b": SMALL}


def _exact(options: dict[str, list[Option]], budget: int) -> float:
    """The least total cost within ``budget`` (a dynamic programme over bytes: the cases' sizes are small)."""
    best = {0: 0.0}
    for name in sorted(options):
        after: dict[int, float] = {}
        for used, cost in best.items():
            for option in options[name]:
                at = used + option.nbytes
                if at <= budget and after.get(at, float("inf")) > cost + option.cost:
                    after[at] = cost + option.cost
        best = after
    return min(best.values())


def test_on_random_cases_the_choice_fits_and_costs_within_a_few_per_cent_of_the_optimum() -> None:
    """Thirty tensors of five random options each (more bytes, less cost), a budget between the smallest and the
    largest: the choice fits, and its cost is the exact optimum's within 1 % on average and 5 % at worst (a
    knapsack's greedy is not exact: it can miss by about one tensor's step, which many tensors make small)."""
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(40):
        options = {}
        for i in range(30):
            sizes = np.sort(rng.choice(np.arange(5, 60), size=5, replace=False))
            costs = np.sort(rng.random(5))[::-1]
            options[f"t{i:02d}"] = [Option(k, int(s), float(c))
                                    for k, (s, c) in enumerate(zip(sizes, costs, strict=True))]
        low = sum(o[0].nbytes for o in options.values())
        budget = int(rng.integers(low, sum(o[-1].nbytes for o in options.values())))
        found = choose(options, budget)
        assert found is not None
        chosen = [next(o for o in options[n] if o.ggml_type == found[n]) for n in options]
        assert sum(o.nbytes for o in chosen) <= budget
        ratios.append(sum(o.cost for o in chosen) / _exact(options, budget))
    assert min(ratios) >= 1 - 1e-12
    assert np.mean(ratios) <= 1.01 and max(ratios) <= 1.05, ratios


def test_the_recorded_pairs_match_each_name_alone() -> None:
    pairs = chosen_pairs({"blk.1.ffn_up.weight": ggml.Q3_K, "blk.0.attn_q.weight": ggml.Q4_K})
    assert pairs == ("blk.0.attn_q.weight=q4_k", "blk.1.ffn_up.weight=q3_k")
    assert chosen_patterns(pairs) == (r"^blk\.0\.attn_q\.weight$=q4_k", r"^blk\.1\.ffn_up\.weight$=q3_k")


def test_which_tensors_a_target_chooses_and_among_which_types() -> None:
    assert chosen_tensor("blk.3.ffn_down.weight", (256, 1536))
    assert chosen_tensor("blk.0.attn_k.weight", (64, 576))  # legacy types: 576 is not whole 256-value blocks
    assert not chosen_tensor("token_embd.weight", (49152, 576))
    assert not chosen_tensor("output.weight", (49152, 576))
    assert not chosen_tensor("blk.0.attn_norm.weight", (576,))
    assert not chosen_tensor("blk.0.attn_q.weight", (64, 100))  # not whole 32-value blocks: as its mix writes it
    # the i-quants publishers ship below 4 bits (the 1-bit ones too) beside the K-quants; on rows not whole
    # 256-value blocks the 32-value types llama.cpp falls them back to (IQ4_NL the i-quants')
    assert candidate_types(512) == (ggml.IQ1_S, ggml.IQ1_M, ggml.IQ2_XXS, ggml.IQ2_XS, ggml.IQ2_S, ggml.Q2_K,
                                    ggml.IQ3_XXS, ggml.IQ3_S, ggml.Q3_K, ggml.IQ4_XS, ggml.Q4_K, ggml.Q5_K, ggml.Q6_K,
                                    ggml.Q8_0)
    assert candidate_types(576) == (ggml.Q4_0, ggml.IQ4_NL, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0)
    assert candidate_types(100) == ()
    assert type_bytes(ggml.Q4_K, (3, 512)) == 3 * 2 * 144
    assert type_bytes(ggml.Q8_0, (2, 64)) == 2 * 2 * 34


def test_costs_fall_with_bits_and_weigh_columns_by_importance() -> None:
    """On random weights each candidate type costs less than the one with fewer bits; a column of importance 0
    costs nothing however it is quantized (its error times 0), so costs with half the columns unimportant are
    the important half's alone."""
    weight = torch.from_numpy(np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32))
    ones = np.ones(512, dtype=np.float32)
    kinds = (ggml.Q2_K, ggml.Q3_K, ggml.Q4_K, ggml.Q5_K, ggml.Q6_K, ggml.Q8_0)
    costs = quantization_costs(weight, ones, kinds)
    assert all(costs[i] > costs[i + 1] > 0 for i in range(len(costs) - 1)), costs
    assert 0.005 < costs[2] < 0.05  # Q4_K: a few per cent of the signal's power
    # the i-quants, each below the K-quant of about its bits: IQ2_S (2.5 bits) < Q2_K (2.6), IQ3_S (3.4) < Q3_K
    # (3.4), IQ4_XS (4.25) about Q4_K (4.5)
    iquants = (ggml.IQ2_S, ggml.IQ3_S, ggml.IQ4_XS)
    found = dict(zip(iquants, quantization_costs(weight, ones, iquants), strict=True))
    assert found[ggml.IQ2_S] < costs[0] and found[ggml.IQ3_S] < costs[1], (found, costs)
    assert found[ggml.IQ4_XS] < 1.5 * costs[2], (found, costs)
    half = ones.copy()
    half[256:] = 0
    blocked = weight.clone()
    blocked[:, 256:] = 1e3  # huge values where nothing is important: they change the other half's blocks not
    masked = quantization_costs(blocked, half, (ggml.Q8_0,))
    alone = quantization_costs(weight[:, :256].contiguous(), ones[:256], (ggml.Q8_0,))
    assert masked[0] == pytest.approx(alone[0], rel=1e-12)


WIDTH = 64  # rows of two 32-value blocks: the 32-value candidates (a few quick encoders)


class _Layer(torch.nn.Module):
    """A decoder layer of two matrices over its input: what ``loud`` gives is added to what leaves the layer,
    a thousandth of what ``quiet`` gives; the input itself ``scale`` times."""

    def __init__(self, quiet: torch.Tensor, loud: torch.Tensor, scale: float = 1.0) -> None:
        super().__init__()
        self.quiet = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.loud = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.quiet.weight.data, self.loud.weight.data, self.scale = quiet, loud, scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scale * h + 1e-3 * self.quiet(h) + self.loud(h)


class _Stream:
    """What the importance pass's step asks of a model stream, over layers already in memory."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers_list = layers

    @contextmanager
    def loaded(self, module: torch.nn.Module, read: Any = None) -> Iterator[torch.nn.Module]:
        yield module

    def prefix(self, module: torch.nn.Module) -> str:
        return f"model.layers.{next(i for i, m in enumerate(self.layers_list) if m is module)}."

    @staticmethod
    def run(layer: torch.nn.Module, hidden: torch.Tensor, call: object, *, hand_on: bool = True) -> torch.Tensor:
        return layer(hidden)

    @staticmethod
    def entered(hidden: torch.Tensor, call: object, index: int | None = None) -> torch.Tensor:
        return hidden


def _measured(layers: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The costs the importance pass's step measures on ``layers`` over two random texts."""
    g = torch.Generator().manual_seed(3)
    hidden = [[torch.randn((1, n, WIDTH), generator=g) for n in (40, 24)]]
    step = SumStep(_Stream(layers), [[None] * len(layers)] * 2, unreserved, costs=True)  # type: ignore[arg-type]
    with torch.no_grad():
        for index in range(len(layers)):
            hidden = step.layer(index, hidden)
    return step.finish(hidden)[2]


def _heavy(seed: int) -> torch.Tensor:
    """Weights whose blocks hold outliers (Student's t, 2 degrees of freedom): a larger relative error at every
    type than normal weights'."""
    return torch.from_numpy(np.random.default_rng(seed).standard_t(2, (WIDTH, WIDTH)).astype(np.float32) * 0.02)


def test_a_matrix_whose_error_moves_the_output_more_gets_more_bits_than_its_weight_error_gives_it() -> None:
    """Two matrices of one layer on the same input: ``quiet``'s weights lose more to quantization (outliers in its
    blocks), but only a thousandth of its output leaves the layer. By the weight error alone it would get the
    bits; measured by the error each makes in the layer's output, ``loud`` gets them."""
    loud = torch.from_numpy(np.random.default_rng(2).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.02)
    weights = {"quiet": quantization_costs(_heavy(1), np.ones(WIDTH, dtype=np.float32), candidate_types(WIDTH)),
               "loud": quantization_costs(loud, np.ones(WIDTH, dtype=np.float32), candidate_types(WIDTH))}
    assert all(weights["quiet"] > weights["loud"])  # the weight error alone favours quiet
    costs = _measured([_Layer(_heavy(1), loud)])
    assert set(costs) == {"model.layers.0.quiet", "model.layers.0.loud"}
    options = {name.rpartition(".")[2]: [Option(int(t), type_bytes(int(t), (WIDTH, WIDTH)), float(c))
                                         for t, c in zip(*values.tolist(), strict=True)]
               for name, values in costs.items()}
    budget = type_bytes(ggml.Q8_0, (WIDTH, WIDTH)) + type_bytes(ggml.Q4_0, (WIDTH, WIDTH))  # one at 8 bits, one at 4
    choice = choose(options, budget)
    assert choice is not None
    assert choice == {"loud": ggml.Q8_0, "quiet": ggml.IQ4_NL}, choice  # IQ4_NL: Q4_0's bytes, less error
    by_weight = choose({name: [Option(o.ggml_type, o.nbytes, float(w)) for o, w in zip(opts, weights[name],
                                                                                         strict=True)]
                        for name, opts in options.items()}, budget)
    assert by_weight is not None
    assert type_bytes(by_weight["quiet"], (WIDTH, WIDTH)) >= type_bytes(by_weight["loud"], (WIDTH, WIDTH))


def test_an_earlier_layers_costs_carry_the_gain_of_the_layers_after_it() -> None:
    """A layer that triples its input (and adds nothing: its matrices' weights 0) multiplies an error entering it
    by 9 in squares: its gain, measured; the layer before it has its costs carried through it (9 times what its
    output error was), the last layer's are its own."""
    zero = torch.zeros((WIDTH, WIDTH))
    loud = torch.from_numpy(np.random.default_rng(2).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.02)
    layers: list[torch.nn.Module] = [_Layer(_heavy(1), loud), _Layer(zero, zero, scale=3.0)]
    h = [torch.randn((1, 16, WIDTH), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        tripled = Rerun(_Stream(layers), layers[1], 1, [None], h, [layers[1](h[0])])  # type: ignore[arg-type]
        assert tripled.gain() == pytest.approx(9.0, rel=1e-6)
    alone = _measured(layers[:1])
    both = _measured(layers)
    for name in ("model.layers.0.quiet", "model.layers.0.loud"):
        assert torch.equal(both[name][0], alone[name][0])
        assert both[name][1].tolist() == pytest.approx((9.0 * alone[name][1]).tolist(), rel=1e-6)
    types = torch.tensor([float(ggml.Q4_0)], dtype=torch.float64)
    found = carried({"a.0.x": torch.stack([types, torch.tensor([2.0], dtype=torch.float64)]),
                     "a.1.x": torch.stack([types, torch.tensor([3.0], dtype=torch.float64)])},
                    {"a.1.": torch.tensor([1.0, 5.0], dtype=torch.float64),
                     "a.0.": torch.tensor([0.0, 7.0], dtype=torch.float64)})
    assert found["a.0.x"][1].tolist() == [10.0] and found["a.1.x"][1].tolist() == [3.0]


def _reference_costs(weight: torch.Tensor, importance: np.ndarray, types: tuple[int, ...], chunk_values: int,
                     measured_rows: int) -> np.ndarray:
    """The costs as the module docstring defines them, written out plainly: every ``-(-rows // measured_rows)``-th
    row, chunks of ``chunk_values`` values of whole rows, each chunk encoded at each type and decoded back, its
    importance-weighted squared error and signal summed in float64 chunk by chunk."""
    from resumerge.inputs.gguf.blocks import decode
    from resumerge.outputs.gguf.encoders import encode

    rows = weight[::-(-weight.shape[0] // measured_rows)].contiguous()
    step = max(1, chunk_values // rows.shape[1])
    w = importance.astype(np.float64)
    signal, errors = 0.0, np.zeros(len(types))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        values = chunk.numpy().astype(np.float64)
        signal += float(np.dot((values * values).sum(axis=0), w))
        for k, kind in enumerate(types):
            back = decode(encode(chunk.clone(), kind, importance=importance.copy()), kind).numpy()
            errors[k] += float(np.dot(((values - back) ** 2).sum(axis=0), w))
    return errors / signal


@pytest.mark.parametrize(("shape", "chunk_values", "measured_rows"), [
    ((5, 256), 1 << 20, 512),  # a few rows of one K block: every K- and i-quant candidate
    ((7, 768), 1000, 512),  # a row a chunk, odd row count
    ((11, 96), 200, 4),  # the 32-value candidates; every third row sampled, chunks of two rows
])
@pytest.mark.parametrize("importance", ["ones", "random", "some zero"])
def test_costs_are_the_plain_encode_decode_error_bit_for_bit(
        shape: tuple[int, int], chunk_values: int, measured_rows: int, importance: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization_costs (however it shares or schedules its work) gives exactly the bits of the plain
    definition, at every candidate type of the row: the costs choose the types, so the file's bytes and the plan's
    fingerprint hang on them."""
    from resumerge.outputs.gguf import sensitivity

    monkeypatch.setattr(sensitivity, "CHUNK_VALUES", chunk_values)
    monkeypatch.setattr(sensitivity, "MEASURED_ROWS", measured_rows)
    rng = np.random.default_rng(sum(shape))
    weight = torch.from_numpy((rng.standard_normal(shape) * rng.uniform(0.1, 3.0, (shape[0], 1))).astype(np.float32))
    columns = {"ones": np.ones(shape[1]), "random": rng.uniform(0.01, 5.0, shape[1]),
               "some zero": rng.uniform(0.0, 1.0, shape[1]) * (np.arange(shape[1]) % 5 != 0)}[importance]
    weights = columns.astype(np.float32)
    types = candidate_types(shape[1])
    found = quantization_costs(weight, weights, types)
    expected = _reference_costs(weight, weights, types, chunk_values, measured_rows)
    assert found.dtype == np.float64 and found.tobytes() == expected.tobytes(), (found, expected)


def test_costs_run_their_kernels_on_the_calling_thread_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's decode is a few dozen small torch kernels a type: split over torch's threads each waits for a core
    the pass's other work holds (a tiny llama's costs took twice the CPU on two busy threads). They run on the
    calling thread alone, whatever torch's count, and the caller's count is back after."""
    from resumerge.inputs.gguf import blocks
    from resumerge.inputs.kernels import _openmp, kernel_threads

    if _openmp() is None:
        pytest.skip("no OpenMP runtime found: the kernels' thread count cannot be set per thread")
    seen: list[int] = []
    plain = blocks.decode

    def counted(stored: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return plain(stored, ggml_type, out)

    monkeypatch.setattr(blocks, "decode", counted)
    weight = torch.from_numpy(np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32))
    with kernel_threads(2, process_wide=False):
        quantization_costs(weight, np.ones(64, dtype=np.float32), candidate_types(64))
        assert torch.get_num_threads() == 2
    assert seen == [1] * len(candidate_types(64))
