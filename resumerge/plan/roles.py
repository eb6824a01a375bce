"""What a plan reads and writes by stored format and role: each input model's format and how many of its stored
tensors are weights, quantization companions or other tensors (:attr:`~resumerge.plan.merge_plan.Plan.input_roles`),
and the same of the output, from each output tensor's stored parts. ``plan`` reports it (text and ``--json``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from resumerge.inputs.codecs import MAIN, PLAIN, Role
from resumerge.plan.merge_plan import Plan

# The format of a model or output none of whose tensors a quantized format claims.
PLAIN_FORMAT = PLAIN.name


def output_roles(plan: Plan) -> dict[str, int]:
    """How many stored output tensors have each role: a plain tensor is "other", a quantized one's main part a
    "weight" and each further part a "companion" (every role listed)."""
    counts: Counter[str] = Counter()
    for tp in plan.tensors.values():
        if tp.out_codec.plain:
            counts[Role.OTHER.value] += 1
            continue
        for part in tp.stored_parts():
            counts[(Role.WEIGHT if part.part == MAIN else Role.COMPANION).value] += 1
    return {role.value: counts[role.value] for role in Role}


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
    return {"inputs": inputs, "output": {"format": _name(written), "roles": output_roles(plan)}}


def formats_line(report: dict[str, Any]) -> str:
    """Each input's stored format and role counts, then the output's (a :func:`formats_report`), on one line (what
    ``plan`` prints and the run's ledger records)."""

    def counts(roles: dict[str, int]) -> str:
        return ", ".join(f"{n} {role}" for role, n in roles.items())

    models = [f"{model}: {m['format']} ({counts(m['roles'])})" for model, m in report["inputs"].items()]
    out = report["output"]
    return "; ".join([*models, f"output: {out['format']} ({counts(out['roles'])})"])


def quantized(report: dict[str, Any]) -> bool:
    """Whether a model or the output of ``report`` (:func:`formats_report`) is stored in a quantized format."""
    return any(m["format"] != PLAIN_FORMAT for m in (*report["inputs"].values(), report["output"]))


def _name(formats: set[str]) -> str:
    return "+".join(sorted(formats)) or PLAIN_FORMAT
