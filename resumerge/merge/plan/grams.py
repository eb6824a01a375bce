"""A method that merges linears with their inputs' Gram matrices (``regmean``, :attr:`MethodSpec.gram_inputs`): each
planned linear weight given every input model's measured Gram as further inputs, checked before a weight is read.

The Grams come from a finished ``resumerge measure`` folder (the global parameter ``grams``, see
:mod:`resumerge.inputs.grams`), each model's found by its weight files' identities. A Gram joins the plan as an input
like any stored tensor: its folder is one more entry of the plan's inputs (``<model>#grams``), so the engine reads
it through its input sources, ``plan`` counts its bytes, and a resume refuses a Gram file that changed. Before that,
every file a plan reads is hashed and compared with the sha256 ``measure`` recorded, and a Gram missing for one
model, or of a shape that does not fit the weight, is refused (exit 2, one line naming ``parameters.grams``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from resumerge.errors import ConfigError
from resumerge.inputs.files import file_identity
from resumerge.inputs.grams import MANIFEST, MeasuredModel, Measurement, read_measurement, sha256_of
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import Header, read_header
from resumerge.merge.methods.regmean import GRAM, GRAMS, RATIO, SPEC_PLUS
from resumerge.merge.plan.merge_plan import InputRef, TensorPlan

WHERE = "parameters.grams"
PLUS_NAME = SPEC_PLUS.name
SUFFIX = "#grams"


@dataclass
class GramInputs:
    """What attaching the Grams adds to a plan: the Gram folders as inputs (files by key, folder by key) and a note."""

    files: dict[str, tuple[tuple[str, int, str], ...]] = field(default_factory=dict)
    dirs: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Folders:
    """Each Gram folder's measurement, each file's header and verified sha256, read once per plan."""

    measurements: dict[str, Measurement] = field(default_factory=dict)
    headers: dict[Path, Header] = field(default_factory=dict)
    used: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)  # key -> file -> (size, identity)
    read: int = 0

    def measurement(self, folder: str) -> Measurement:
        found = self.measurements.get(folder)
        if found is None:
            found = self.measurements[folder] = read_measurement(Path(folder), yaml_path=WHERE)
        return found

    def header(self, folder: str, measured: MeasuredModel, file: str) -> Header:
        path = Path(folder) / file
        found = self.headers.get(path)
        if found is not None:
            return found
        if not path.is_file():
            raise ConfigError(f"the Gram file {path} of {measured.key} is missing", yaml_path=WHERE,
                              hint=f"measure again into {folder}, or restore the file")
        digest = sha256_of(path)
        if digest != measured.sha256.get(file):
            raise ConfigError(f"the Gram file {path} changed since it was measured (sha256 {digest[:12]}…, "
                              f"measured {measured.sha256.get(file, 'none')[:12]}…)", yaml_path=WHERE,
                              hint=f"measure again into {folder}")
        found = self.headers[path] = read_header(path)
        self.read += path.stat().st_size
        return found


def attach_grams(tensors: Mapping[str, TensorPlan], models: Mapping[str, ModelInput], method: str
                 ) -> tuple[dict[str, TensorPlan], GramInputs]:
    """``tensors`` with each 2-D tensor of ``method`` whose inputs are linear weights with measured Grams given
    those Grams as further inputs (after the weights, marked by the per-model parameter ``GRAM``), and what the plan
    must add for them. Raises :class:`ConfigError` naming ``parameters.grams`` for a model the folder did not
    measure, a Gram missing for some inputs of a linear, one whose shape does not fit, or a changed file."""
    folders = _Folders()
    added = GramInputs()
    out: dict[str, TensorPlan] = {}
    solved = 0
    for name, tp in tensors.items():
        folder = dict(tp.params).get(GRAMS)
        if tp.method != method or len(tp.shape) != 2 or not isinstance(folder, str):
            out[name] = tp
            continue
        found = _grams_of(tp, models, folder, folders, added)
        if found is None:
            out[name] = tp
            continue
        solved += 1
        out[name] = replace(tp, inputs=tp.inputs + tuple(found), compute_dtype=None,
                            model_params=tp.model_params + tuple(((GRAM, True),) for _ in found))
    for key, files in folders.used.items():
        added.files[key] = tuple((file, size, identity) for file, (size, identity) in sorted(files.items()))
    if solved:
        manifests = ", ".join(f"{Path(f) / MANIFEST} sha256 {sha256_of(Path(f) / MANIFEST)}"
                              for f in sorted(folders.measurements))
        added.notes.append(f"{method}: {solved} linear weight(s) solved from their Gram matrices "
                           f"({folders.read / 1e6:.1f} MB of Grams, each file's sha256 checked against {manifests}); "
                           "every other tensor averaged")
    return out, added


def _grams_of(tp: TensorPlan, models: Mapping[str, ModelInput], folder: str, folders: _Folders,
              added: GramInputs) -> list[InputRef] | None:
    """The Gram inputs of ``tp`` (one per input, config order), or None when none of its inputs has one."""
    measurement = folders.measurement(folder)
    _check_pass(tp, measurement, folder)
    entries: list[tuple[MeasuredModel, str] | None] = []
    for ref in tp.inputs:
        model = models[ref.model]
        if model.adapter is not None:  # its files are the base's, whose Grams would be taken for the adapted model
            raise ConfigError(f"{ref.model} is a base+adapter reference: its Grams are not its base's, and measure "
                              "runs whole models", yaml_path=WHERE,
                              hint="merge the adapter into its base first, then measure and merge that model")
        measured = measurement.find(tuple((f.name, f.size, f.identity) for f in model.files))
        if measured is None:
            raise ConfigError(f"{folder} holds no Grams of {ref.model} (it measured "
                              f"{', '.join(m.key for m in measurement.models) or 'no model'})", yaml_path=WHERE,
                              hint=f"measure a config that lists {ref.model}")
        module = ref.tensor.removesuffix(".weight")
        entries.append((measured, module) if ref.tensor.endswith(".weight") and module in measured.grams else None)
    if all(e is None for e in entries):
        return None
    missing = next((i for i, e in enumerate(entries) if e is None), None)
    if missing is not None:
        raise ConfigError(f"the Gram of {tp.inputs[missing].tensor} of {tp.inputs[missing].model} is missing from "
                          f"{folder}, which has the other models' (output tensor {tp.name})", yaml_path=WHERE,
                          hint="measure every model of the merge with the same resumerge version")
    if measurement.merged is not None and {id(e[0]) for e in entries if e} != {id(m) for m in measurement.models}:
        raise ConfigError(f"the Grams in {folder} were measured on the merge of {len(measurement.models)} models, "
                          f"but {tp.name} merges {len(tp.inputs)} of them", yaml_path=WHERE,
                          hint="RegMean++'s Grams hold for the merge they were measured for: measure this config")
    found = []
    for ref, entry in zip(tp.inputs, entries):
        assert entry is not None
        measured, module = entry
        gram = measured.grams[module]
        if gram.size != tp.shape[1] or ref.shape[-1] != gram.size:
            raise ConfigError(f"the Gram of {module} of {ref.model} in {folder} is {gram.size} × {gram.size}, but "
                              f"the weight has {ref.shape[-1]} inputs", yaml_path=WHERE,
                              hint="the folder measured another model; measure this one")
        header = folders.header(folder, measured, gram.file)
        stored = header.tensors.get(gram.tensor)
        if stored is None or tuple(stored.shape) != (gram.size, gram.size) or stored.dtype != "F32":
            raise ConfigError(f"{Path(folder) / gram.file} has no float32 {gram.size} × {gram.size} tensor "
                              f"{gram.tensor}", yaml_path=WHERE, hint=f"measure again into {folder}")
        key = ref.model + SUFFIX
        added.dirs[key] = str(Path(folder).resolve())
        files = folders.used.setdefault(key, {})
        if gram.file not in files:
            path = Path(folder) / gram.file
            files[gram.file] = (path.stat().st_size, file_identity(path, header.raw))
        found.append(InputRef(key, gram.file, gram.tensor, stored.dtype, tuple(stored.shape), stored.start,
                              stored.end))
    return found


def _check_pass(tp: TensorPlan, measurement: Measurement, folder: str) -> None:
    """Refuse Grams of the other pass: RegMean++ (``regmean_plus``) needs Grams measured on its own merged layers,
    at its ratio; ``regmean`` needs each model's own."""
    merged = measurement.merged
    if tp.method == PLUS_NAME:
        ratio = float(dict(tp.params)[RATIO])
        if merged is None or merged.get("method") != PLUS_NAME or float(merged.get(RATIO, -1)) != ratio:
            had = "each model's own forward" if merged is None else f"a merge at {RATIO} {merged.get(RATIO)}"
            raise ConfigError(f"{PLUS_NAME} needs Grams measured on its merged layers at {RATIO} {ratio}, and "
                              f"{folder} holds Grams of {had}", yaml_path=WHERE,
                              hint="measure this config into a new folder: resumerge measure CONFIG DIR")
    elif merged is not None:
        raise ConfigError(f"{folder} holds RegMean++ Grams (measured on a merge's layers), which {tp.method} does "
                          "not take", yaml_path=WHERE, hint="measure this config into a new folder")
