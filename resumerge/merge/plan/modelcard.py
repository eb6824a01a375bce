"""The output's README.md: a Hugging Face model card describing the merge, made from the plan and the config.

Like mergekit's card: YAML front matter (``base_model``, ``library_name``, ``tags``), the merge method, the models
and the config as given. Unlike mergekit's (mergekit-semantics.md defect 7) it makes no network call — whether a
model came from the hub is read from the plan (a hub input's directory is ``models--org--name/snapshots/<commit>``
in the Hugging Face cache), which also gives the exact commit that was merged — and it holds no timestamps, so
the bytes are a pure function of (plan, config text) and a resumed run writes the identical file. A donor
model's own README.md is never copied.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import yaml

from resumerge.config.merge_config import MergeConfig, load_config_text
from resumerge.merge.methods.registry import get_method
from resumerge.merge.plan.cardwording import MERGE_WORDING

if TYPE_CHECKING:
    from resumerge.config.modelref import ModelRef
    from resumerge.merge.plan.merge_plan import Plan

CARD_NAME = "README.md"
CARD_TAGS = ("mergekit", "merge", "resumerge")
_HUB = "https://huggingface.co"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_commit(path: str, directory: str) -> str | None:
    """The commit a hub model was merged at, or None for a local model.

    ``directory`` is the model's entry in :attr:`Plan.model_dirs`; a hub input's is the Hugging Face cache
    snapshot ``.../models--<org>--<name>/snapshots/<commit>`` of repo ``path``. A local path that happens to
    point into a cache snapshot is still local (its ``path`` is not the repo id).
    """
    parts = PurePosixPath(directory.replace("\\", "/")).parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not _COMMIT.match(parts[-1]):
        return None
    if path.startswith(("/", ".", "~")) or parts[-3] != "models--" + path.replace("/", "--"):
        return None
    return parts[-1]


def render_model_card(plan: Plan, config_text: str) -> bytes:
    """The README.md bytes for ``plan`` merged from ``config_text`` (the YAML as given; it is shown verbatim).

    Deterministic: depends only on the config, the plan's method and layer count, and the hub commits in
    ``plan.model_dirs``. No network call, no clock.
    """
    # What a kind of run that is not a merge config (MoE upcycling) lists is in its plan: never asked here.
    config = plan.card_config if plan.card_config is not None else load_config_text(config_text)
    title, summary, reference = plan.card_method if plan.card_method is not None else _about(plan.method)
    words = plan.card_wording if plan.card_wording is not None else MERGE_WORDING
    refs = config.referenced_models()
    commits = {ref.key: hub_commit(ref.path, plan.model_dirs.get(ref.key, "")) for ref in refs}
    hub_ids: list[str] = []
    for ref in refs:
        if commits[ref.key] is not None and ref.path not in hub_ids:
            hub_ids.append(ref.path)
    meta: dict[str, object] = {}
    if hub_ids:
        meta["base_model"] = hub_ids
    if not plan.container.self_contained:  # a GGUF is no transformers folder: its "gguf" tag says what it is
        meta["library_name"] = "transformers"
    meta["tags"] = [*CARD_TAGS, *words.tags, *plan.container.card_tags]
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, allow_unicode=True)
    lines = ["---", front.rstrip("\n"), "---", f"# {config.name or words.title}", ""]
    lines += [
        words.lead,
        "",
        f"## {words.method_heading}",
        "",
        _method_line(plan.method, title, summary, reference),
        "",
        "## Models",
        "",
    ]
    bases = _base_keys(config)
    roles = dict(words.roles) or {key: "base model" for key in bases}
    lines += [_model_line(ref, commits[ref.key], roles.get(ref.key)) for ref in refs]
    lines += [""]
    shown: set[str] = set()
    for heading, section in words.sections:
        lines += [f"## {heading}", "", *(f"- {line}" for line in section), ""]
        shown.update(section)
    lines += plan.container.card_lines([s.name for s in plan.shards], plan.out_config)
    if config.slices:
        lines += ["## Layers", "", f"The output has {plan.num_layers} layers:", ""]
        lines += _slice_lines(config)
        lines += [""]
    if plan.accounting is not None:
        lines += ["## Input tensors", "", plan.accounting.summary() + ".", ""]
    notes = [note for note in plan.notes if note not in shown]
    if notes:
        lines += ["## Notes", "", *(f"- {note}" for note in notes), ""]
    fence = _fence(config_text)
    lines += [f"## {words.config_heading}", "", words.config_intro, ""]
    lines += [f"{fence}{words.config_language}", config_text.rstrip("\n"), fence, ""]
    return "\n".join(lines).encode("utf-8")


def _about(method: str) -> tuple[str, str, str]:
    """What the method's declaration says of it for the card: (display name, description, link); a name the
    registry does not know is shown bare."""
    spec = get_method(method)
    if spec is None:
        return method, "", ""
    return spec.title or spec.name, spec.summary, spec.reference


def _method_line(method: str, name: str, description: str, reference: str) -> str:
    title = f"[{name}]({reference})" if reference else name
    return f"{title} (`{method}`): {description}".rstrip(": ")


def _base_keys(config: MergeConfig) -> set[str]:
    keys = {config.base_model.key} if config.base_model is not None else set()
    keys.update(sl.base_model.key for sl in config.all_slices() if sl.base_model is not None)
    return keys


def _model_line(ref: ModelRef, commit: str | None, role_name: str | None) -> str:
    if commit is None:
        return f"- {_code(ref.key)} (local{', ' + role_name if role_name else ''})"
    role = f" ({role_name})" if role_name else ""
    revision = f", revision {_code(ref.revision)}" if ref.revision else ""
    return (f"- [{ref.path}]({_HUB}/{ref.path}){role}{revision}, "
            f"commit [`{commit}`]({_HUB}/{ref.path}/tree/{commit})")


def _slice_lines(config: MergeConfig) -> list[str]:
    lines = []
    start = 0
    for sl in config.slices or ():
        first = sl.sources[0].layer_range or (0, 0)
        length = first[1] - first[0]
        where = f"layer {start}" if length == 1 else f"layers {start}–{start + length - 1}"
        if length == 0:
            where = "no layers"
        sources = ", ".join(
            f"{_code(s.model.key)} layers [{(s.layer_range or (0, 0))[0]}, {(s.layer_range or (0, 0))[1]})"
            for s in sl.sources
        )
        lines.append(f"- {where}: {sources}")
        start += length
    return lines


def _code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it contains."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if longest else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _fence(text: str) -> str:
    """A code fence longer than any backtick run at the start of a line of ``text``."""
    longest = max((len(m) for m in re.findall(r"^\s*(`{3,})", text, flags=re.MULTILINE)), default=0)
    return "`" * max(3, longest + 1)
