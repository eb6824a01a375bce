"""The short text of a plan, as ``resumerge plan`` starts it: the headline (method, tensors, layers, shards, where
config and tokenizer come from) and the plan's own facts. A :class:`~resumerge.plan.merge_plan.Plan` shows it as
its ``repr`` — a notebook cell ending in ``api.plan_merge(...)`` printed the whole plan, every tensor (255 KB for
a small model) — and :mod:`resumerge.engine.costs_text` starts an estimate's text with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from resumerge.memory.sizes import format_size

if TYPE_CHECKING:
    from resumerge.plan.merge_plan import Plan

# The width of a field's label, as ``plan`` aligns them.
LABEL_WIDTH = 13


def headline(plan: Plan) -> str:
    """``linear: 39 tensors, 4 layers, 1 shard(s); config from A, tokenizer from A``."""
    return (f"{plan.method}: {len(plan.tensors)} tensors, {plan.num_layers} layers, {len(plan.shards)} shard(s); "
            f"config from {plan.donor}, {tokenizer_origin(plan)}")


def tokenizer_origin(plan: Plan) -> str:
    """Where the output's tokenizer comes from: a donor's copy, built by the plan (``tokenizer_source: union``,
    ``tokenizer:``), or none at all (--no-copy-tokenizer)."""
    if plan.tokenizer_donor is not None:
        return f"tokenizer from {plan.tokenizer_donor}"
    if plan.tokenizer_files:
        return "tokenizer built from the inputs' tokenizers"
    return "no tokenizer (--no-copy-tokenizer)"


def plan_fields(plan: Plan) -> list[tuple[str, str]]:
    """The plan's own facts as ``plan`` prints them, (label, text): the formats of a quantized merge, what became
    of the input tensors, the filters."""
    from resumerge.plan.roles import formats_line, formats_report, quantized

    fields = []
    formats = formats_report(plan)
    if quantized(formats):  # a plain merge's summary is unchanged
        fields.append(("formats", formats_line(formats)))
    if plan.accounting is not None:
        fields.append(("inputs", plan.accounting.summary()))
    fields += [("filter", f"{f.yaml_path} {f.pattern!r}: {f.tensors} tensor(s)") for f in plan.filters]
    return fields


def field_line(label: str, text: str) -> str:
    """One ``label  text`` line, the label padded as ``plan`` pads it."""
    return f"{label:<{LABEL_WIDTH}}{text}"


def plan_text(plan: Plan) -> str:
    """The plan in a few lines: its headline, the output's size, its facts and notes, and its fingerprint."""
    lines = [headline(plan),
             field_line("output", f"{format_size(plan.total_bytes)} of shards ({len(plan.shards)} shard(s))"),
             *(field_line(label, text) for label, text in plan_fields(plan)),
             *(field_line("note", note) for note in plan.notes)]
    if plan.fingerprint:
        lines.append(field_line("fingerprint", plan.fingerprint))
    return "\n".join(lines)
