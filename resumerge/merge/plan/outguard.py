"""OUT against what the run reads: a run never writes into a folder it reads.

An OUT that is an input model's folder, or holds one, holds files with the very names a merge plans
(``model.safetensors``, ``config.json``, the tokenizer's): the run would overwrite the weights it is reading, and
``--restart`` (which deletes the files of the run it replaces) would delete them first. So every kind of run —
each stage of a recipe, MoE upcycling, a LoRA extraction, ``plan`` — refuses such an OUT (exit 2) as soon as its
plan is made, before anything is computed or deleted: :func:`refuse_out_over_inputs`, over the plan's model
folders (``model+adapter`` adapters, ``tokenizer_source`` models and hub snapshots included: every input is one)
and every input file, compared by real path (links resolved; ``./x`` and ``x`` alike).

OUT *inside* an input's folder (``model: ./m``, OUT ``./m/merged``) is allowed: an input is read from its folder's
own files, never from its subfolders (no input is listed recursively), and nothing resumerge writes or deletes lies
outside OUT, so neither reaches the input's files.

:func:`read_paths` gives the real paths of the files a plan reads, for the deletions' own guard: a sink never
deletes or replaces one of them, whatever decided it (:class:`~resumerge.merge.store.sink.LocalDirSink`).

:func:`refuse_state_in_out` refuses a state dir that is OUT or lies inside it (the ledger would be OUT's first
file). A state dir inside an input's folder is left alone: what resumerge writes there (``<run>-<hash>/``, the hub
records) is named unlike any model file, and nothing an input is read from is listed recursively.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from resumerge.config.locations import StateDir, default_state_root
from resumerge.errors import UsageError
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.merge_plan import Plan

_HINT = "write the output to a new folder outside the inputs' folders"

# An input as the guard sees it: (its key, its folder, the names of the files read from it).
Place = tuple[str, str, tuple[str, ...]]


def refuse_out_over_inputs(out: str | os.PathLike[str], plan: Plan, *, what: str = "OUT") -> None:
    """Raise :class:`UsageError` (exit 2) when ``out`` (``what`` names it in the message) is, or contains, the
    folder of an input of ``plan`` or one of the files it reads."""
    refuse_out_over(out, plan_places(plan), what=what)


def refuse_out_over(out: str | os.PathLike[str], places: Iterable[Place], *, what: str = "OUT") -> None:
    """:func:`refuse_out_over_inputs` over the inputs ``places``."""
    problem = overlap(out, places, what=what)
    if problem is not None:
        raise UsageError(problem, path=str(out), hint=_HINT)


def overlap(out: str | os.PathLike[str], places: Iterable[Place], *, what: str = "OUT") -> str | None:
    """Why ``out`` must not be written or cleaned (it is, or holds, one of the inputs ``places``), or None."""
    real_out = os.path.realpath(out)
    for key, folder, files in places:
        real = os.path.realpath(folder)
        if real == real_out or _inside(real, real_out):
            where = "is the folder" if real == real_out else f"contains the folder ({folder})"
            return (f"{what} {where} of the input {key}, which this run reads: writing there would overwrite (and "
                    "--restart delete) its files")
        for name in files:
            if _inside(os.path.realpath(Path(folder) / name), real_out):
                return (f"{what} holds {name} of the input {key} ({folder}), which this run reads: writing there "
                        "would overwrite (and --restart delete) it")
    return None


def refuse_state_in_out(out: str | os.PathLike[str], state: StateDir, *,
                        what: str = "OUT") -> None:
    """Raise :class:`UsageError` (exit 2) when the state dir in force (``state``) is ``out`` or lies inside it:
    the run's ledger would be the first thing in OUT, which then holds files that are not the merge's (a new OUT
    was refused as "not written by resumerge", exit 4)."""
    real_out, root = os.path.realpath(out), state.root
    real = os.path.realpath(root)
    if real == real_out or _inside(real, real_out):
        where = "is" if real == real_out else "is inside"
        raise UsageError(f"the state dir {root} {where} {what}: resumerge keeps each run's ledger there, and {what} "
                         "holds only the output's files", path=str(out),
                         hint=f"pass a --state-dir outside {what} (or none: the default is {default_state_root()})")


def read_paths(plan: Plan) -> frozenset[str]:
    """The real path of every file ``plan`` reads."""
    return frozenset(os.path.realpath(Path(folder) / name) for _, folder, files in plan_places(plan)
                     for name in files)


def plan_places(plan: Plan) -> Iterator[Place]:
    """Every input of ``plan``: its models, their adapters, a recipe's earlier stages (their planned folders)."""
    for key, folder in sorted(plan.model_dirs.items()):
        yield key, folder, tuple(entry[0] for entry in plan.inputs.get(key, ()))


def model_places(models: Mapping[str, ModelInput]) -> Iterator[Place]:
    """Every opened model of ``models`` and its adapter."""
    for key, model in sorted(models.items()):
        yield key, str(model.directory), tuple(f.name for f in model.files)
        if model.adapter is not None:
            yield key, str(model.adapter.directory), tuple(f.name for f in model.adapter.files)


def _inside(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip(os.sep) + os.sep)
