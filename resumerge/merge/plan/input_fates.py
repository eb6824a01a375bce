"""Every stored tensor of every input model sorted by what a plan's output tensors do with it (the rule is in
:mod:`resumerge.merge.plan.accounting`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.accounting import COPIED, MERGED, RENUMBERED, Accounting, Drops, ModelAccount
from resumerge.merge.plan.architecture import split_layer_name
from resumerge.merge.plan.merge_plan import TensorPlan
from resumerge.merge.plan.nonfloat import NONFLOAT_COPY


def account(tensors: Mapping[str, TensorPlan], models: Mapping[str, ModelInput], drops: Drops) -> Accounting:
    """Sort every stored tensor of every model of ``models`` (recognised: see
    :meth:`~resumerge.inputs.model.ModelInput.recognised`) by what the output ``tensors`` do with it."""
    fate: dict[tuple[str, str], int] = {}  # by (model, stored name): the rank in _FATES of its furthest fate
    seen = fate.get
    for tp in tensors.values():
        # A non-float tensor's other inputs are only compared with the base's (the planner says so in ``drops``).
        read = tp.inputs if tp.method != NONFLOAT_COPY else (tp.inputs[tp.base_index or 0],)
        for ref in read:
            # Layers are compared only for a lone input (a merge's 46k tensors need no name parsed).
            rank = _MERGED if len(read) > 1 else _RENUMBERED if _layer(ref.tensor) != _layer(tp.name) else _COPIED
            at = (ref.model, ref.tensor)
            if seen(at, -1) < rank:
                fate[at] = rank
            for _, c in ref.companions:  # no tuple of the reference and its companions: 92k of them
                at = (c.model, c.tensor)
                if seen(at, -1) < rank:
                    fate[at] = rank
    accounts = {}
    for key, model in models.items():
        stored_names = stored_names_of(model)
        counts = [0] * len(_FATES)
        dropped: Counter[str] = Counter()
        for name in stored_names:
            found = seen((key, name))
            if found is None:
                dropped[drops.reason(key, name)] += 1
            else:
                counts[found] += 1
        accounts[key] = ModelAccount(len(stored_names), counts[_MERGED], counts[_COPIED], counts[_RENUMBERED],
                                     dict(sorted(dropped.items())))
    return Accounting(accounts)


# The fates by rank: a tensor read several ways gets the furthest (merged over renumbered over copied).
_FATES = (COPIED, RENUMBERED, MERGED)
_COPIED, _RENUMBERED, _MERGED = range(len(_FATES))


def stored_names_of(model: ModelInput) -> Mapping[str, object]:
    """Every stored tensor of ``model`` by name (a recognised model's companions included)."""
    return model.formats.stored if model.formats is not None else model.tensors


def _layer(name: str) -> int | None:
    parts = split_layer_name(name)
    return None if parts is None else parts[1]
