"""What a plan reads and writes by stored format and role: each input model's format and how many of its stored
tensors are weights, quantization companions or other tensors
(:attr:`~resumerge.merge.plan.merge_plan.Plan.input_roles`), and the same of the output, from each output tensor's
stored parts. ``plan`` reports it (text and ``--json``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from resumerge.inputs.codecs import MAIN, PLAIN, Role, TensorEncoder
from resumerge.merge.plan.merge_plan import Plan
from resumerge.outputs.gguf.releasecodec import ReleaseCodec, parts_of_file

# The format of a model or output none of whose tensors a quantized format claims.
PLAIN_FORMAT = PLAIN.name


def output_roles(plan: Plan) -> dict[str, int]:
    """How many stored output tensors have each role: a plain tensor is "other", a quantized one's main part a
    "weight" and each further part a "companion" (every role listed). A GGUF release's tensors are counted once,
    as its first file stores them (each file holds every tensor: :func:`release_files` names them)."""
    counts: Counter[str] = Counter()
    # The parts a codec writes depend on the value's dtype and shape, never on its name (only their stored names
    # do): counted once per codec, dtype and shape, not for each of 46k tensors (the codec held: its id stays).
    roles_of: dict[tuple[int, str, tuple[int, ...]], tuple[TensorEncoder, Counter[str]]] = {}
    for tp in plan.tensors.values():
        codec = tp.out_codec
        if codec.plain:
            counts[Role.OTHER.value] += 1
            continue
        key = (id(codec), tp.out_dtype, tp.shape)
        found = roles_of.get(key)
        if found is None:
            parts = codec.out_parts(tp.name, tp.out_dtype, tp.shape)
            if isinstance(codec, ReleaseCodec):
                parts = tuple(parts_of_file(codec.files[0], parts, lambda p: p.part))
            found = roles_of[key] = (codec, _roles(p.part for p in parts))
        counts.update(found[1])
        if tp.carried:  # the companions stored beside it: parts too (see TensorPlan.stored_parts)
            counts.update(_roles(part for part, _ in tp.carried))
    return {role.value: counts[role.value] for role in Role}


def _roles(parts: Iterable[str]) -> Counter[str]:
    """The roles of stored parts named ``parts``: the main part a weight, any other a companion (a GGUF release's
    part ``FILE:main`` is its file's main part: :func:`~resumerge.outputs.gguf.releasecodec.file_part`)."""
    return Counter((Role.WEIGHT if part.rpartition(":")[2] == MAIN else Role.COMPANION).value for part in parts)


def formats_report(plan: Plan) -> dict[str, Any]:
    """``{"inputs": {model: {"format", "roles"}}, "output": {"format", "roles"}}``; a format is the name of the
    quantized formats found (joined by "+", sorted), else "plain"."""
    found: dict[str, set[str]] = {model: set() for model in plan.inputs}
    for tp in plan.tensors.values():
        for ref in tp.inputs:
            if not ref.codec.plain:
                found.setdefault(ref.model, set()).add(ref.codec.name)
    written = {tp.out_codec.name for tp in plan.tensors.values() if not tp.out_codec.plain}
    inputs = {model: {"format": _name(names),
                      "roles": dict(plan.input_roles.get(model, {}))} for model, names in sorted(found.items())}
    output: dict[str, Any] = {"format": _name(written), "roles": output_roles(plan)}
    files = release_files(plan)
    if files:
        output["files"] = list(files)
    return {"inputs": inputs, "output": output}


def release_files(plan: Plan) -> tuple[str, ...]:
    """The files of a GGUF release each of which holds every output tensor (none for any other output)."""
    return next((tp.out_codec.files for tp in plan.tensors.values() if isinstance(tp.out_codec, ReleaseCodec)), ())


def formats_line(report: dict[str, Any]) -> str:
    """Each input's stored format and role counts, then the output's (a :func:`formats_report`), on one line (what
    ``plan`` prints and the run's ledger records)."""

    def counts(roles: dict[str, int]) -> str:
        return ", ".join(f"{n} {role}" for role, n in roles.items())

    models = [f"{model}: {m['format']} ({counts(m['roles'])})" for model, m in report["inputs"].items()]
    out = report["output"]
    files = out.get("files") or ()
    each = f", in each of {', '.join(files)}" if files else ""
    return "; ".join([*models, f"output: {out['format']} ({counts(out['roles'])}{each})"])


def quantized(report: dict[str, Any]) -> bool:
    """Whether a model or the output of ``report`` (:func:`formats_report`) is stored in a quantized format."""
    return any(m["format"] != PLAIN_FORMAT for m in (*report["inputs"].values(), report["output"]))


def _name(formats: set[str]) -> str:
    return "+".join(sorted(formats)) or PLAIN_FORMAT
