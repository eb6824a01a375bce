"""A GGUF output's options checked and normalised at the API's front door (exit 2, before any work): the mix
(``--gguf-type``, either case), the per-tensor type flags and llama-quantize's switches, and the importance
matrix (``--imatrix`` or the texts of ``--imatrix-texts``, each recorded by its digest, never its path)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from resumerge.config.outformats import takes
from resumerge.errors import UsageError


def gguf_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF options of the plan options ``given`` (every group's fields by name) checked and normalised, to
    set over them; the tensor-type file (``TYPE_FILE``) read into its pairs: the plan records the pairs, never the
    path, so the caller drops that field."""
    _gguf_type(given)
    return _gguf_choices(given)


DEFAULT_GGUF_TYPE = "f16"  # what --gguf-type is when not given
# The GGUF type options, by field: the flag that sets each
TYPE_FILE = "gguf_tensor_type_file"
_GGUF_CHOICES = MappingProxyType({"gguf_tensor_types": "--gguf-tensor-type", "gguf_output_type": "--gguf-output-type",
                                  "gguf_token_embedding_type": "--gguf-token-embedding-type", "imatrix": "--imatrix",
                                  "imatrix_texts": "--imatrix-texts", TYPE_FILE: "--gguf-tensor-type-file",
                                  "gguf_override_kv": "--gguf-override-kv", "gguf_pure": "--pure",
                                  "gguf_target_size": "--gguf-target-size", "gguf_target_bpw": "--gguf-target-bpw"})


def _gguf_type(given: Mapping[str, Any]) -> None:
    """A GGUF output's ``--gguf-type`` checked (exit 2, before any work): one of llama-quantize's file types that
    resumerge does not write yet is named as such, and a mix llama.cpp's quantizer refuses without an importance
    matrix (Q2_K_S) is refused without ``--imatrix`` or ``--imatrix-texts``."""
    if not takes(given.get("out_type"), "gguf_type"):
        return
    kinds = gguf_types(given.get("gguf_type"))
    if len(kinds) > 1 and given.get("gguf_split_max_size") is not None:
        raise UsageError(f"--gguf-type {','.join(kinds)} with --gguf-split-max-size: a release of several types is "
                         "written as one file per type, not split yet", hint="give one type to split its file")
    if len(set(kinds)) < len(kinds):
        raise UsageError(f"--gguf-type {','.join(kinds)}: a type given twice (one file per type)")
    for mix in kinds:
        _one_type(mix, given)


def gguf_types(given: object) -> list[str]:
    """The types ``--gguf-type`` names (one, or a comma list: a release of one file per type), lower-cased."""
    return [kind.strip() for kind in str(given or DEFAULT_GGUF_TYPE).lower().split(",")]


def _one_type(mix: str, given: Mapping[str, Any]) -> None:
    """One type of ``--gguf-type`` checked: see :func:`_gguf_type`."""
    from resumerge.merge.plan.gguftypes import MIXES

    if (mix in MIXES and MIXES[mix].needs_imatrix and given.get("imatrix") is None
            and given.get("imatrix_texts") is None):
        raise UsageError(f"--gguf-type {mix}: llama.cpp's quantizer writes it only with an importance matrix",
                         hint="give --imatrix FILE (llama-imatrix's) or --imatrix-texts FILE (texts to compute it "
                              "on the merge from)")


def _gguf_choices(given: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF type options of ``given`` checked and normalised (patterns and type names lower-cased: llama.cpp's
    ``Q4_K_M`` is ``q4_k_m``; the importance matrix an absolute path that exists); UsageError (exit 2) naming the
    flag for a bad one, or for one given without ``--out-type gguf`` (a ``--gguf-type`` other than the default
    too: ignored, it would write safetensors the user did not ask for)."""
    from resumerge.merge.plan.defaults import GGUF_TYPES
    from resumerge.merge.plan.ggufswitches import parse_override_kv, tensor_type_file
    from resumerge.merge.plan.gguftypes import MIXES, OVERRIDE_TYPES, parse_tensor_types

    out: dict[str, Any] = {}
    if given.get("gguf_type") is not None:
        kinds = gguf_types(given["gguf_type"])
        out["gguf_type"] = ",".join(kinds)
        for each in kinds:
            if each not in MIXES:  # the CLI's GGUF_TYPES, and f32 for a notebook
                which = f"{each} is not " if len(kinds) > 1 else ""
                raise UsageError(f"--gguf-type {given['gguf_type']}: {which}one of {', '.join(GGUF_TYPES)} (or a "
                                 "comma list of them: one file per type)")
    set_ = [flag for name, flag in _GGUF_CHOICES.items() if given.get(name)]
    if out.get("gguf_type", DEFAULT_GGUF_TYPE) != DEFAULT_GGUF_TYPE:
        set_.insert(0, "--gguf-type")
    if not set_:  # the CLI's unset repeatable flag is None, the plan's default an empty tuple
        return {**out, **{name: () for name in ("gguf_tensor_types", "gguf_override_kv") if name in given}}
    if not takes(given.get("out_type"), "gguf_type"):
        raise UsageError(f"{set_[0]} chooses a GGUF output's types: give it with --out-type gguf")
    pairs = list(given.get("gguf_tensor_types") or ())
    try:
        if given.get(TYPE_FILE) is not None:
            pairs += tensor_type_file(Path(given[TYPE_FILE]).expanduser(), parse_tensor_types)
        out["gguf_tensor_types"] = tuple(f"{p}={t}" for p, t in
                                         ((pair.partition("=")[0].lower(), pair.partition("=")[2].lower())
                                          for pair in pairs))
        parse_tensor_types(out["gguf_tensor_types"])
        out["gguf_override_kv"] = tuple(given.get("gguf_override_kv") or ())
        for spec in out["gguf_override_kv"]:
            parse_override_kv(spec)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"--gguf-tensor-type-file {given[TYPE_FILE]}: cannot be read "
                         f"({error.strerror or error})") from None
    for name in ("gguf_output_type", "gguf_token_embedding_type"):
        kind = given.get(name)
        if kind is not None:
            if str(kind).lower() not in OVERRIDE_TYPES:
                raise UsageError(f"{_GGUF_CHOICES[name]} {kind}: one of {', '.join(OVERRIDE_TYPES)}")
            out[name] = str(kind).lower()
    if given.get("imatrix") is not None:
        path = Path(given["imatrix"]).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"--imatrix {given['imatrix']}: no such file (an importance matrix llama-imatrix "
                             "wrote, GGUF or .dat)")
        out["imatrix"], out["imatrix_sha256"] = str(path), file_sha256(path)
    if given.get("imatrix_texts") is not None:
        out["imatrix_texts"] = _imatrix_texts({**given, **out})
        out["imatrix_texts_sha256"] = file_sha256(Path(out["imatrix_texts"]))
    return {**out, **_target({**given, **out})}


def _target(given: Mapping[str, Any]) -> dict[str, Any]:
    """``--gguf-target-size SIZE`` (bytes) or ``--gguf-target-bpw X`` checked (exit 2, before any work): one of
    them, with the texts whose pass measures the costs (``--imatrix-texts``), one file, the decoder layers' types
    the target's alone; none given: nothing."""
    size, bpw = given.get("gguf_target_size"), given.get("gguf_target_bpw")
    if size is None and bpw is None:
        return {}
    flag = "--gguf-target-size" if size is not None else "--gguf-target-bpw"
    if size is not None and bpw is not None:
        raise UsageError("--gguf-target-size and --gguf-target-bpw both set the size the GGUF's types are chosen "
                         "for: give one")
    if given.get("imatrix_texts") is None:
        raise UsageError(f"{flag} chooses each tensor's type by what quantizing it costs the merge on texts: give "
                         "--imatrix-texts FILE (the texts the importance matrix and the costs are measured on)")
    if given.get("gguf_split_max_size") is not None:
        raise UsageError(f"{flag} sizes one GGUF file: not with --gguf-split-max-size")
    if len(gguf_types(given.get("gguf_type"))) > 1:
        raise UsageError(f"{flag} sizes one GGUF file: not with a --gguf-type list (a release; run the target "
                         "alone, or give the list without it)")
    if given.get("gguf_tensor_types"):
        raise UsageError(f"{flag} chooses the decoder layers' types: not with --gguf-tensor-type or "
                         "--gguf-tensor-type-file (give one)")
    if size is not None:  # bytes: plan_options read the SIZE
        return {"gguf_target_size": size}
    try:
        bits = float(str(bpw))
    except ValueError:
        bits = math.nan
    if not math.isfinite(bits) or bits <= 0:
        raise UsageError(f"--gguf-target-bpw {bpw}: a number of bits per weight above 0 (e.g. 4.5)")
    return {"gguf_target_bpw": bits}


def file_sha256(path: Path) -> str:
    """The digest of the bytes of the file at ``path`` (the user's ``--imatrix`` or ``--imatrix-texts``), as the
    plan's options record it in place of the path: what the output's bytes depend on."""
    from resumerge.machine.checksums import hash_file

    return hash_file(path)[1]


def _imatrix_texts(given: Mapping[str, Any]) -> str:
    """``--imatrix-texts`` checked (exit 2): not with ``--imatrix``, a file, and a ``--gguf-type`` whose quantizer
    reads an importance matrix; the file as an absolute path."""
    from resumerge.merge.plan.gguftypes import MIXES, reads_matrix

    if given.get("imatrix") is not None:
        raise UsageError("--imatrix FILE and --imatrix-texts FILE both give the importance matrix: give one (a "
                         "file llama-imatrix wrote, or texts to compute it on the merge from)")
    mix = str(given.get("gguf_type") or "f16")
    if not any(kind in MIXES and reads_matrix(kind) for kind in gguf_types(mix)):
        target = next((_GGUF_CHOICES[name] for name in ("gguf_target_size", "gguf_target_bpw")
                       if given.get(name) is not None), None)
        if target is not None:  # --gguf-type unset, or f16: what the target does not choose is the mix's
            raise UsageError(f"{target} chooses the types of the decoder layers' matrices; the tensors it does not "
                             f"choose are written as --gguf-type's mix ({mix}), which reads no importance matrix",
                             hint="give the mix for them with it: --gguf-type q4_k_m (or another K-quant or "
                                  "i-quant mix)")
        raise UsageError(f"--imatrix-texts: --gguf-type {mix} takes no importance matrix",
                         hint="give a K-quant or i-quant mix (q2_k ... q6_k, iq4_xs ...), a legacy or ternary "
                              "type (q4_0, q4_1, q5_0, q5_1, tq1_0, tq2_0)")
    path = Path(given["imatrix_texts"]).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"--imatrix-texts {given['imatrix_texts']}: no such file (texts, one a line, to compute "
                         "the importance matrix on the merge from)")
    return str(path)
