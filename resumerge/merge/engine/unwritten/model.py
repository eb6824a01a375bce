"""A planned merge opened as a model that is never written: its small files in a folder of their own under the state
dir, its weights read through :class:`~resumerge.merge.engine.unwritten.merged.MergedFiles`.

What reads a stored model needs its folder (config.json, the tokenizer) and where its tensors lie; an
:class:`UnwrittenMerge` has both as a stored model has them: :attr:`~UnwrittenMerge.opened` is the
:class:`~resumerge.inputs.model.ModelInput` of the output the plan would write (:func:`~resumerge.merge.plan.outmodel.
planned_model`), whose folder holds the small files ``run`` writes into OUT that a reader reads (config.json, the
tokenizer files) and no weight, and :attr:`~UnwrittenMerge.source` gives the bytes of its weight files. The folder is
named by those files' bytes, made once (in a temporary folder renamed into place) and found again after; no weight is
ever written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from resumerge.config.closing import Closing
from resumerge.errors import StorageError
from resumerge.inputs.files import CONFIG_NAME, TensorSource
from resumerge.inputs.model import ModelInput
from resumerge.inputs.source import InputSources
from resumerge.machine.memory import MemoryGovernor
from resumerge.merge.engine.compute import SharedInputs
from resumerge.merge.engine.unwritten.merged import MergedFiles
from resumerge.merge.methods.resources import NO_RESOURCES, Resources
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.outconfig import render_config
from resumerge.merge.plan.outmodel import planned_model
from resumerge.merge.plan.sidefiles import aux_files, render_aux
from resumerge.merge.plan.workunits import estimate_bytes

# The small files of the output a merge's folder holds: what reads a model's folder reads (the index, the card and
# the config's copy say nothing a reader needs, and without the copy the candidates of a generation, whose configs
# differ, share one folder).
_KINDS = ("tokenizer",)


class UnwrittenMerge(Closing):
    """The merge ``plan`` as a model never written: :attr:`opened` as a stored model is opened
    (its folder :attr:`directory`, its :attr:`config`, its stored :attr:`tensors`), :attr:`source` the bytes of its
    weight files, each tensor merged when read from ``inputs`` (the plan's inputs by model key, the caller's to
    close; default: their folders, ``plan.model_dirs``, closed with it). ``root``: where its folder is made (the
    state dir's :attr:`~resumerge.config.locations.StateDir.unwritten_dir`); ``name`` names it in errors;
    ``resources``, ``governor`` and ``shared`` as for :class:`MergedFiles`; ``on_close``: called once it is closed
    (what its maker opened for it).

    Close it (or use it as a context manager) to close its inputs."""

    def __init__(self, plan: Plan, root: Path, *, inputs: InputSources | None = None,
                 resources: Resources = NO_RESOURCES, governor: MemoryGovernor | None = None,
                 name: str = "merge", on_close: Callable[[], None] | None = None,
                 shared: SharedInputs | None = None) -> None:
        self.plan = plan
        self._on_close = on_close
        self._owns_inputs = inputs is None
        self.inputs = inputs if inputs is not None else InputSources.local(plan.model_dirs)
        self.source = MergedFiles(plan, self.inputs, resources, governor=governor, shared=shared)
        self.opened: ModelInput = planned_model(name, plan, merge_folder(plan, root))

    @property
    def directory(self) -> Path:
        """Its folder: the output's small files, no weight."""
        return self.opened.directory

    @property
    def config(self) -> Mapping[str, Any]:
        """Its config.json, as ``run`` writes it."""
        return self.opened.config

    @property
    def tensors(self) -> Mapping[str, TensorSource]:
        """Every stored tensor, where the plan puts it in its files."""
        return self.opened.tensors

    @property
    def merge_bytes(self) -> int:
        """The largest working set of one tensor's merge (its inputs, its method's temporaries, its output): what a
        read admits at most through the governor beside what the reader holds, as ``run`` admits its units."""
        return max((estimate_bytes(tp, self.plan.method_of(tp)) for tp in self.plan.tensors.values()), default=0)

    def tensor_merge_bytes(self, name: str, rows: int | None = None) -> int | None:
        """The working set of output tensor ``name``'s merge (of ``rows`` of its rows: where
        :meth:`merges_rows_alone`, what a read of those rows merges); None for a name the plan does not make."""
        tp = self.plan.tensors.get(name)
        return None if tp is None else estimate_bytes(tp, self.plan.method_of(tp), rows=rows)

    def merges_rows_alone(self, name: str) -> bool:
        """Whether a read of some rows of output tensor ``name`` merges those rows alone
        (:func:`~resumerge.merge.engine.unwritten.compute.rows_alone`)."""
        from resumerge.merge.engine.unwritten.compute import rows_alone

        tp = self.plan.tensors.get(name)
        return tp is not None and rows_alone(tp, self.plan.method_of(tp))

    def close(self) -> None:
        self.source.close()
        if self._owns_inputs:
            self.inputs.close()
            self._owns_inputs = False
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def merge_folder(plan: Plan, root: Path) -> Path:
    """The folder under ``root`` of the merge ``plan``: the small files ``run`` writes into OUT that a reader of a
    model's folder reads (config.json and the tokenizer files), named by their bytes (merges whose files are the
    same share it), made when it is not there yet. Raises StorageError where it cannot be made."""
    files = {CONFIG_NAME: render_config(plan.out_config)}
    files.update((aux.name, render_aux(plan, aux, "")) for aux in aux_files(plan) if aux.kind in _KINDS)
    digest = hashlib.sha256()
    for name, data in sorted(files.items()):
        digest.update(f"{name}\x00{len(data)}\x00".encode())
        digest.update(data)
    folder = root / f"merge-{digest.hexdigest()[:16]}"
    if (folder / CONFIG_NAME).is_file():
        return folder
    building = root / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    try:
        building.mkdir(parents=True)
        for name, data in files.items():
            (building / name).write_bytes(data)
        try:
            building.rename(folder)
        except OSError:  # another process made it meanwhile
            if not (folder / CONFIG_NAME).is_file():
                raise
    except OSError as exc:  # a full or read-only state dir
        raise StorageError(f"cannot make the folder of the unwritten merge in the state dir: {exc}",
                           path=str(folder), hint="give a --state-dir on a writable local filesystem") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder
