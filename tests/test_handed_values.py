"""A decoder layer's extra output may be None (RWKV's state, run without a cache): it is handed on to the layer that
takes it as a value, journaled and restored as one, while a slot whose layer has not run is still refused. Before,
None meant "not run": ``check`` of RWKV refused at its second layer ("takes what an earlier layer returned beside
its hidden states, which this pass no longer holds")."""

from __future__ import annotations

import pytest

from resumerge.errors import ModelInputError
from resumerge.forward.handed import HandingCall, Slot, carried, given, restore


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
