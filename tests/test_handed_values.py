"""A decoder layer's extra output may be None (RWKV's state, run without a cache): it is handed on to the layer that
takes it as a value, journaled and restored as one, while a slot whose layer has not run is still refused. Before,
None meant "not run": ``check`` of RWKV refused at its second layer ("takes what an earlier layer returned beside
its hidden states, which this pass no longer holds")."""

from __future__ import annotations

import pytest

from resumerge.errors import ModelInputError
from resumerge.forward.engine.handed import HandingCall, Slot, carried, given, restore


def _calls() -> list[list[list[object]]]:
    """One model's one batch: layer 0 returns an extra output, layer 1 takes it as ``state``."""
    slot = Slot()
    return [[[HandingCall(((), {}), (slot,)), ((), {"state": slot})]]]


def test_a_none_extra_output_is_handed_on_journaled_and_restored() -> None:
    calls = _calls()
    later = calls[0][0][1]
    with pytest.raises(ModelInputError, match="takes what an earlier layer returned"):
        given(later, 1)  # layer 0 has not run
    calls[0][0][0].slots[0].value = None  # type: ignore[attr-defined]
    assert given(later, 1) == ((), {"state": None})
    journal = carried(calls, 0)
    assert list(journal) == ["carried.0.0.0.0.none"]
    resumed = _calls()
    restore(resumed, journal)
    assert given(resumed[0][0][1], 1) == ((), {"state": None})


def test_a_call_moved_to_a_device_keeps_the_slots_its_layer_hands_on() -> None:
    # (before, a layer's call moved to a GPU was a plain tuple: the values its layer returned beside its hidden
    # states went nowhere, and the layer taking them was refused; ``cpu:0`` is moved to as a GPU is)
    from resumerge.forward.engine.device import moved
    from resumerge.machine.torch_import import torch

    calls = _calls()
    on = moved(calls[0][0], torch.device("cpu:0"))
    assert isinstance(on[0], HandingCall) and on[0].slots == calls[0][0][0].slots  # type: ignore[attr-defined]


def test_a_value_the_forward_computed_from_earlier_outputs_is_computed_again_from_the_passs() -> None:
    # (Inkling 2's block states: its forward stacks the states entering its block-boundary layers between layer
    # calls; a stand-in's output is traced, and what a later call holds of it computed again as that layer runs)
    import torch

    from resumerge.forward.engine.handed import Output, handed_on, handing, traced

    out = Output()
    entering = torch.ones(1, 2, 3)
    stacked = torch.cat([entering.unsqueeze(-2), traced(entering, out).unsqueeze(-2)], dim=-2)
    calls = handing([((), {}), ((stacked,), {"other": traced(entering, out).shape[0]})], [(), ()], [out, Output()])
    assert isinstance(calls[0], HandingCall) and calls[0].slots == (out,)
    assert handed_on(calls[0], (entering * 5, "more")) is not None
    (block,), kwargs = given(calls[1], 1)
    assert kwargs == {"other": 1} and torch.equal(block, torch.stack([entering, entering * 5], dim=-2))
    assert [k.split(".")[3:] for k in carried([[calls]], 0)] == [["0", "0"]]  # journaled for layer 1


def test_the_hidden_states_a_loops_start_is_given_are_computed_again_from_the_passs_outputs() -> None:
    # (Dory: each loop starts from its normed output plus its input section's normed output, not from the previous
    # call's output alone; a call given the previous output as it is, or cast to its own dtype, takes it as it is)
    import torch

    from resumerge.forward.engine.handed import Output, entered, handed_on, handing, traced

    outs = [Output(), Output(), Output()]
    first = torch.ones(1, 2, 3)
    seen = [first, traced(first, outs[0]), traced(first, outs[1]) * 2 + traced(first, outs[0]),
            traced(first * 3, outs[2]).to(torch.float32)]  # (a stand-in returns what it is given)
    calls = handing([((), {})] * 4, [(), (), (), ()], [*outs, Output()], seen)
    assert [getattr(c, "entering", None) is None for c in calls] == [True, True, False, True]
    assert calls[0].slots == (outs[0],) and calls[1].slots == (outs[1],)  # (the outputs the loop's start takes)
    handed_on(calls[0], first * 3)
    handed_on(calls[1], first * 5)
    assert torch.equal(entered(calls[2], first * 5, 2), first * 13)  # 5 * 2 + 3, from the pass's outputs
    assert [k.split(".")[3:] for k in carried([[calls]], 1)] == [["0", "0"], ["1", "0"]]  # journaled after call 1
    assert entered(calls[3], first * 7) is not None and torch.equal(entered(calls[3], first * 7), first * 7)
