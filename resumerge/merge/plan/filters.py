"""What each ``filter:`` of a config matched: counted while a plan is built, reported by ``plan``, and a filter
that matches nothing of the merge refused before anything is read.

A filter (a conditional entry of a parameter, see :mod:`resumerge.config.params`) is counted where the planner
consults its level for a parameter of the chosen method, whether or not an earlier level or an earlier entry
already gave the value: the count says how many output tensors the pattern selects in the filter's scope (its
slice, its model, the whole merge for top-level ``parameters``), not how many took their value from it.

When to refuse: mergekit configs are copied between models and between slices, and a substring filter that
matches nothing *in its scope* is often legitimate there (a ``lm_head`` entry in the parameters of a middle slice,
whose non-layer tensors come from the first and last slices; a ``self_attn`` entry in a block repeated for a slice
of MLP-only layers). A pattern that matches no tensor name of the *whole merge* — no input tensor of any model
and no output tensor — can only be a typo or a pattern written for other models, and it silently leaves every
tensor at another value (issue 44: a glob mergekit read as a substring matched nothing, exit 0). Only that case is
refused; a filter with no match in its scope but some in the merge is reported with its count of 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from resumerge.config.params import Setting, filter_matches, is_catch_all, is_glob
from resumerge.errors import ConfigError


@dataclass(frozen=True)
class FilterMatch:
    """One consulted ``filter:``: its YAML path (``slices[0].parameters.t[1].filter``), its pattern, and how many
    output tensors of its scope it matched."""

    yaml_path: str
    pattern: str
    tensors: int

    def to_json(self) -> dict[str, Any]:
        """``{"yaml_path", "pattern", "tensors"}``, as ``plan --json`` lists it."""
        return {"yaml_path": self.yaml_path, "pattern": self.pattern, "tensors": self.tensors}


class FilterTally:
    """The filters one plan build consults, and the output tensors each matched (one tally per build; nothing
    outlives it but :meth:`matches`). ``places`` are the config's ``parameters:`` mappings: without a filter among
    them (most configs), :meth:`observe` returns at once, so planning pays nothing for it."""

    def __init__(self, places: Iterable[tuple[str, Mapping[str, Setting]]] = ()) -> None:
        self._hits: dict[tuple[str, str], set[str]] = {}
        self._active = any(_has_filter(s) for _, params in places for s in params.values())

    @property
    def active(self) -> bool:
        """Whether the config has a filter at all (else :meth:`observe` does nothing)."""
        return self._active

    def observe(self, levels: Iterable[tuple[Mapping[str, Setting], str]], param: str, match_name: str,
                out_name: str) -> None:
        """Count, for output tensor ``out_name``, every filter of parameter ``param`` at every level of ``levels``
        (``(parameters, YAML path)``) against ``match_name`` (the name the level's filters are matched against)."""
        if not self._active:
            return
        for params, path in levels:
            setting = params.get(param)
            if not _has_filter(setting):
                continue
            for i, entry in enumerate(setting):
                pattern = entry.get("filter")
                if pattern is None or is_catch_all(pattern):
                    continue
                hits = self._hits.setdefault((f"{path}.{param}[{i}].filter", pattern), set())
                if filter_matches(pattern, match_name):
                    hits.add(out_name)

    def matches(self) -> tuple[FilterMatch, ...]:
        """Every consulted filter with its count, in the order the planner first consulted them."""
        return tuple(FilterMatch(path, pattern, len(hits)) for (path, pattern), hits in self._hits.items())

    def refuse_unmatched(self, names: Iterable[str]) -> None:
        """Raise :class:`ConfigError` (one line: the YAML path and the pattern) for the first consulted filter that
        matches none of ``names`` (every input tensor name of every model and every output tensor name)."""
        empty = [(path, pattern) for (path, pattern), hits in self._hits.items() if not hits]
        if not empty:
            return
        every = set(names)
        for path, pattern in empty:
            if not any(filter_matches(pattern, name) for name in every):
                how = "a glob over the whole name" if is_glob(pattern) else "a substring, as mergekit matches it"
                raise ConfigError(
                    f"filter {pattern!r} matches no tensor of this merge ({how})",
                    yaml_path=path,
                    hint="check the pattern against the models' tensor names (a glob matches the whole name, "
                         "e.g. model.layers.*.mlp.experts.*), or remove the entry",
                )


def _has_filter(setting: Setting) -> TypeGuard[list[dict[str, Any]]]:
    """Whether ``setting`` is a conditional list with a filter that is not a catch-all."""
    return isinstance(setting, list) and bool(setting) and isinstance(setting[0], dict) and any(
        not is_catch_all(entry.get("filter")) for entry in setting)
