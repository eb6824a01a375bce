"""Short names that tell a check's models apart, for the report's table, the drift chart's legend and the model
card: each local path's last folder name, or as many of its last components as tell it from the other models'
(``a/merged`` and ``b/merged``); a hub repo keeps its ``hf://`` name (no local path in it). The report lists the
full paths once, beside these names; the card, which people publish, has the names only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath

from resumerge.config.hubtarget import is_hub_target


def short_names(paths: Sequence[str]) -> list[str]:
    """A name per path, each as short as tells it from every other distinct path (the same path, the same
    name)."""
    parts = {p: PurePath(p).parts or (p,) for p in paths if not is_hub_target(p)}
    names: dict[str, str] = {}
    for path, mine in parts.items():
        others = [theirs for other, theirs in parts.items() if other != path]
        for k in range(1, len(mine) + 1):
            if all(theirs[-k:] != mine[-k:] for theirs in others):
                break
        names[path] = "/".join(part.strip("/") or "/" for part in mine[-k:]) if k < len(mine) else path
    return [names.get(p, p) for p in paths]


def in_short(text: str, paths: Sequence[str], names: Sequence[str]) -> str:
    """``text`` (a reason of the verdict) with each of ``paths`` written as its short name, longest first (so a
    path inside another is not cut)."""
    for path, name in sorted(zip(paths, names), key=lambda pair: -len(pair[0])):
        if path != name:
            text = text.replace(path, name)
    return text
