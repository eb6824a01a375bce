"""Every stored tensor of every input model sorted by what a plan's output tensors do with it (the rule is in
:mod:`resumerge.plan.accounting`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from resumerge.inputs.model import ModelInput
from resumerge.plan.accounting import COPIED, MERGED, RENUMBERED, Accounting, Drops, ModelAccount
from resumerge.plan.architecture import split_layer_name
from resumerge.plan.merge_plan import TensorPlan
from resumerge.plan.nonfloat import NONFLOAT_COPY


def account(tensors: Mapping[str, TensorPlan], models: Mapping[str, ModelInput], drops: Drops) -> Accounting:
    """Sort every stored tensor of every model of ``models`` (recognised: see
    :meth:`~resumerge.inputs.model.ModelInput.recognised`) by what the output ``tensors`` do with it."""
    fate: dict[tuple[str, str], str] = {}
    rank = {COPIED: 0, RENUMBERED: 1, MERGED: 2}
    for tp in tensors.values():
        # A non-float tensor's other inputs are only compared with the base's (the planner says so in ``drops``).
        read = tp.inputs if tp.method != NONFLOAT_COPY else (tp.inputs[tp.base_index or 0],)
        for ref in read:
            # Layers are compared only for a lone input (a merge's 46k tensors need no name parsed).
            kind = MERGED if len(read) > 1 else RENUMBERED if _layer(ref.tensor) != _layer(tp.name) else COPIED
            for stored in (ref, *(c for _, c in ref.companions)):
                at = (stored.model, stored.tensor)
                if at not in fate or rank[kind] > rank[fate[at]]:
                    fate[at] = kind
    accounts = {}
    for key, model in models.items():
        stored_names = stored_names_of(model)
        counts: Counter[str] = Counter()
        dropped: Counter[str] = Counter()
        for name in stored_names:
            found = fate.get((key, name))
            if found is None:
                dropped[drops.reason(key, name)] += 1
            else:
                counts[found] += 1
        accounts[key] = ModelAccount(len(stored_names), counts[MERGED], counts[COPIED], counts[RENUMBERED],
                                     dict(sorted(dropped.items())))
    return Accounting(accounts)


def stored_names_of(model: ModelInput) -> Mapping[str, object]:
    """Every stored tensor of ``model`` by name (a recognised model's companions included)."""
    return model.formats.stored if model.formats is not None else model.tensors


def _layer(name: str) -> int | None:
    parts = split_layer_name(name)
    return None if parts is None else parts[1]
