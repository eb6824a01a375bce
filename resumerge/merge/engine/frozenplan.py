"""The frozen plan kept in the ledger, so that a resume reloads it instead of planning again (issue 45).

Planning a 90k-tensor merge reads every header and builds every tensor's plan: 15–20 s that a resume used to spend
again only to find the same fingerprint. :func:`freeze` makes the stored form once, when the run is recorded (one
row of the ledger, written in the same transaction as the plan's files and tensors, never rewritten); :func:`thaw`
gives the plan back when nothing it was made from can have changed, else None and the caller plans as before
(whose fingerprint check still refuses changed inputs).

What the stored plan stays valid for (its key): the resumerge version, the plan's own data layout (the fields of
its dataclasses) and every file of every input model folder by name, size and modification time — the same
cheap identity :class:`~resumerge.inputs.model.InputWatch` checks before each commit. The config and options of a
resume are the recorded ones, so they cannot differ. Only a plain merge of local folders is stored (its units, the
planner's own non-float copies, are code: stored without them and given back): a plan whose kind brings its own
units, resources or work beside the merge, or whose inputs come from the hub (their opened
state is needed to fetch them), is planned again on resume. The bytes are a pickle, read only from the state
dir's own ledger, and read back by an unpickler that builds nothing but the plan's own dataclasses and enums, torch
dtypes and a few builtin containers: a ledger someone else tampered with makes the resume plan again, it never runs
a callable the pickle names (pickle's REDUCE of anything else is refused).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import io
import json
import os
import pickle
import zlib
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import get_args, get_type_hints

from resumerge.config.version import __version__
from resumerge.machine.memory.collector import collector_paused
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.resources import NO_RESOURCES
from resumerge.merge.plan.merge_plan import (
    PINNED_KERNELS,
    Plan,
)
from resumerge.merge.plan.nonfloat import UNITS as MERGE_UNITS
from resumerge.merge.plan.prepared import Prepared


def freeze(prepared: Prepared) -> tuple[str, bytes] | None:
    """The stored form of ``prepared``'s plan as (key, bytes), or None when this kind of plan is not stored (see
    the module docstring)."""
    plan, inputs = prepared.plan, prepared.inputs
    if (inputs is None or inputs.hub or plan.units not in ((), MERGE_UNITS) or prepared.resources is not NO_RESOURCES
            or prepared.beside is not None):
        return None
    try:  # units are code: stored without them, given back by thaw
        data = pickle.dumps(replace(plan, units=()), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):  # a part that cannot be stored: plan again on resume
        return None
    return _key(plan.model_dirs), zlib.compress(data, 1)


def thaw(stored: tuple[str, bytes] | None, model_dirs: Mapping[str, str], fingerprint: str) -> Plan | None:
    """The plan ``stored`` by :func:`freeze` for a run of ``fingerprint`` whose inputs are in ``model_dirs`` (the
    recorded ones), or None when there is none or something it was made from may have changed."""
    if stored is None or stored[0] != _key(model_dirs):
        return None
    # A 90k-tensor plan is about a million objects: with the collector on, the objects made so far are scanned
    # again and again while they are made (3-7x the load's own time, more the larger the process already is).
    try:
        with collector_paused():
            plan = _PlanUnpickler(io.BytesIO(zlib.decompress(stored[1]))).load()
    except (zlib.error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError):
        return None  # stored by a build whose classes differ (same version, other code): plan again
    if not isinstance(plan, Plan) or plan.fingerprint != fingerprint:
        return None
    return replace(plan, units=MERGE_UNITS)


class _PlanUnpickler(pickle.Unpickler):
    """Builds only what a plan is made of; any other global the bytes name is refused (UnpicklingError)."""

    _BUILTINS = frozenset({"set", "frozenset", "complex", "slice", "range"})

    def find_class(self, module: str, name: str) -> object:
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "resumerge" or module.startswith("resumerge."):
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"a stored plan may not name {module}.{name}")


def _key(model_dirs: Mapping[str, str]) -> str:
    """What a stored plan stays valid for: version, data layout, the kernels' rule (a plan stored before MKL's
    threads were pinned is planned again, so that its fingerprint is checked against today's:
    :data:`~resumerge.merge.plan.merge_plan.PINNED_KERNELS`), and each input folder's files as they are now."""
    return json.dumps({"version": __version__, "layout": layout(), "kernels": PINNED_KERNELS,
                       "inputs": {key: _folder(directory) for key, directory in sorted(model_dirs.items())}},
                      sort_keys=True)


def _folder(directory: str) -> list[tuple[str, int, int]] | None:
    """(name, size, mtime in ns) of every file of ``directory`` (links followed), sorted; None when unreadable."""
    try:
        with os.scandir(directory) as entries:
            found = []
            for entry in entries:
                if entry.is_file():
                    st = entry.stat()
                    found.append((entry.name, st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return sorted(found)


@functools.cache
def layout(root: type = Plan) -> str:
    """The digest of a stored plan's data layout: the fields of ``root`` and of every dataclass its fields' types
    name (through containers, unions and optionals, and theirs in turn: a tensor's :class:`ExpertStack`, the
    vocabulary's alignment), by module, name and field; a release that changes any of them never reads an older
    stored plan (it plans again instead). A field whose type cannot be resolved is an error here, never a class
    left out."""
    found: dict[type, list[str]] = {}
    pending = [root]
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found[cls] = [f.name for f in fields(cls)]
        hints = get_type_hints(cls, localns=_type_names())
        pending.extend(each for f in fields(cls) for each in _dataclasses_in(hints[f.name]))
    described = sorted((cls.__module__, cls.__qualname__, names) for cls, names in found.items())
    return hashlib.sha256(repr(described).encode()).hexdigest()[:16]


def _dataclasses_in(hint: object) -> list[type]:
    """The dataclasses a type ``hint`` names, itself or as an argument (``tuple[X, ...]``, ``X | None``)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    return [cls for arg in get_args(hint) for cls in _dataclasses_in(arg)]


def _type_names() -> dict[str, object]:
    """The names the plan's modules import for their annotations only (``if TYPE_CHECKING``)."""
    from resumerge.config.merge_config import MergeConfig
    from resumerge.merge.plan.accounting import Accounting
    from resumerge.merge.plan.cardwording import CardWording
    from resumerge.merge.plan.filters import FilterMatch
    from resumerge.merge.vocab import VocabAlignment

    return {"MergeConfig": MergeConfig, "Accounting": Accounting, "CardWording": CardWording,
            "FilterMatch": FilterMatch, "VocabAlignment": VocabAlignment}
