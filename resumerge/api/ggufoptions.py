"""A GGUF output's options checked and normalised at the API's front door (exit 2, before any work): the mix
(``--gguf-type``, either case), the per-tensor type flags and llama-quantize's switches, and the importance
matrix (``--imatrix`` or the texts of ``--imatrix-texts``, each recorded by its digest, never its path)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
_GGUF_CHOICES = {"gguf_tensor_types": "--gguf-tensor-type", "gguf_output_type": "--gguf-output-type",
                 "gguf_token_embedding_type": "--gguf-token-embedding-type", "imatrix": "--imatrix",
                 "imatrix_texts": "--imatrix-texts", TYPE_FILE: "--gguf-tensor-type-file",
                 "gguf_override_kv": "--gguf-override-kv", "gguf_pure": "--pure"}


def _gguf_type(given: Mapping[str, Any]) -> None:
    """A GGUF output's ``--gguf-type`` checked (exit 2, before any work): one of llama-quantize's file types that
    resumerge does not write yet is named as such, and a mix llama.cpp's quantizer refuses without an importance
    matrix (Q2_K_S) is refused without ``--imatrix`` or ``--imatrix-texts``."""
    from resumerge.merge.plan.gguftypes import MIXES, NOT_YET

    mix = str(given.get("gguf_type") or "f16").lower()
    if given.get("out_type") != "gguf":
        return
    if mix in NOT_YET:
        needs = ", which llama.cpp's quantizer writes only with an importance matrix," if NOT_YET[mix] else ""
        raise UsageError(f"--gguf-type {mix}: llama-quantize's {mix.upper()}{needs} is not a type resumerge writes "
                         "yet", hint=f"give one of {', '.join(MIXES)}")
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
        out["gguf_type"] = str(given["gguf_type"]).lower()
        if out["gguf_type"] not in MIXES:  # the CLI's GGUF_TYPES, and f32 for a notebook
            raise UsageError(f"--gguf-type {given['gguf_type']}: one of {', '.join(GGUF_TYPES)}")
    set_ = [flag for name, flag in _GGUF_CHOICES.items() if given.get(name)]
    if out.get("gguf_type", DEFAULT_GGUF_TYPE) != DEFAULT_GGUF_TYPE:
        set_.insert(0, "--gguf-type")
    if not set_:  # the CLI's unset repeatable flag is None, the plan's default an empty tuple
        return {**out, **{name: () for name in ("gguf_tensor_types", "gguf_override_kv") if name in given}}
    if given.get("out_type") != "gguf":
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
    return out


def file_sha256(path: Path) -> str:
    """The digest of the bytes of the file at ``path`` (the user's ``--imatrix`` or ``--imatrix-texts``), as the
    plan's options record it in place of the path: what the output's bytes depend on."""
    from resumerge.machine.checksums import hash_file

    return hash_file(path)[1]


def _imatrix_texts(given: Mapping[str, Any]) -> str:
    """``--imatrix-texts`` checked (exit 2): not with ``--imatrix``, a file, and a ``--gguf-type`` whose quantizer
    reads an importance matrix; the file as an absolute path."""
    from resumerge.merge.plan.gguftypes import MIXES
    from resumerge.outputs.gguf.encoders import WEIGHTED

    if given.get("imatrix") is not None:
        raise UsageError("--imatrix FILE and --imatrix-texts FILE both give the importance matrix: give one (a "
                         "file llama-imatrix wrote, or texts to compute it on the merge from)")
    mix = str(given.get("gguf_type") or "f16")
    if mix not in MIXES or MIXES[mix].default not in WEIGHTED:
        raise UsageError(f"--imatrix-texts: --gguf-type {mix} takes no importance matrix",
                         hint="give a K-quant mix (q2_k ... q6_k), iq4_nl, iq4_xs or q4_0, q4_1, q5_0, q5_1")
    path = Path(given["imatrix_texts"]).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"--imatrix-texts {given['imatrix_texts']}: no such file (texts, one a line, to compute "
                         "the importance matrix on the merge from)")
    return str(path)
