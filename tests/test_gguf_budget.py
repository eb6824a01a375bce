"""``--gguf-target-size``'s choice (``resumerge.merge.plan.ggufbudget``) on cases checked by hand: the knapsack
takes the upgrade that saves the most cost per byte while it fits, never an option dominated by a smaller one, fills
what the hull's steps leave, breaks ties by name; and the costs the importance pass measures
(``resumerge.outputs.gguf.sensitivity``) fall as a type holds more bits, and weigh each column by its importance."""

from __future__ import annotations

import numpy as np
import pytest

from resumerge.inputs.gguf.blocks import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
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
    pairs = chosen_pairs({"blk.1.ffn_up.weight": Q3_K, "blk.0.attn_q.weight": Q4_K})
    assert pairs == ("blk.0.attn_q.weight=q4_k", "blk.1.ffn_up.weight=q3_k")
    assert chosen_patterns(pairs) == (r"^blk\.0\.attn_q\.weight$=q4_k", r"^blk\.1\.ffn_up\.weight$=q3_k")


def test_which_tensors_a_target_chooses_and_among_which_types() -> None:
    assert chosen_tensor("blk.3.ffn_down.weight", (256, 1536))
    assert chosen_tensor("blk.0.attn_k.weight", (64, 576))  # legacy types: 576 is not whole 256-value blocks
    assert not chosen_tensor("token_embd.weight", (49152, 576))
    assert not chosen_tensor("output.weight", (49152, 576))
    assert not chosen_tensor("blk.0.attn_norm.weight", (576,))
    assert not chosen_tensor("blk.0.attn_q.weight", (64, 100))  # not whole 32-value blocks: as its mix writes it
    assert candidate_types(512) == (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0)
    assert candidate_types(576) == (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
    assert candidate_types(100) == ()
    assert type_bytes(Q4_K, (3, 512)) == 3 * 2 * 144
    assert type_bytes(Q8_0, (2, 64)) == 2 * 2 * 34


def test_costs_fall_with_bits_and_weigh_columns_by_importance() -> None:
    """On random weights each candidate type costs less than the one with fewer bits; a column of importance 0
    costs nothing however it is quantized (its error times 0), so costs with half the columns unimportant are
    the important half's alone."""
    weight = torch.from_numpy(np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32))
    ones = np.ones(512, dtype=np.float32)
    costs = quantization_costs(weight, ones, candidate_types(512))
    assert all(costs[i] > costs[i + 1] > 0 for i in range(len(costs) - 1)), costs
    assert 0.005 < costs[2] < 0.05  # Q4_K: a few per cent of the signal's power
    half = ones.copy()
    half[256:] = 0
    blocked = weight.clone()
    blocked[:, 256:] = 1e3  # huge values where nothing is important: they change the other half's blocks not
    masked = quantization_costs(blocked, half, (Q8_0,))
    alone = quantization_costs(weight[:, :256].contiguous(), ones[:256], (Q8_0,))
    assert masked[0] == pytest.approx(alone[0], rel=1e-12)


def test_a_choice_below_four_bits_says_it_is_not_calibrated_yet() -> None:
    """The notes (log, status, card) say a choice holding Q2_K or Q3_K is not calibrated per role yet: measured
    worse than llama.cpp's Q3_K_M mix at its size (docs/output.md); a choice of 4 bits and more says nothing so."""
    from resumerge.merge.plan.ggufbudget import target_notes
    from resumerge.merge.plan.merge_plan import PlanOptions

    low = PlanOptions(gguf_target_size=1_000_000, gguf_chosen_types=chosen_pairs({"blk.0.ffn_up.weight": Q3_K}))
    high = PlanOptions(gguf_target_size=1_000_000, gguf_chosen_types=chosen_pairs({"blk.0.ffn_up.weight": Q4_K}))
    assert any("not calibrated per tensor role yet" in note for note in target_notes(low))
    assert not any("not calibrated" in note for note in target_notes(high))
