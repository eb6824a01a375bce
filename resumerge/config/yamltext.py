"""A config file's bytes to text, and text to YAML documents, with the two checks plain PyYAML skips.

A config saved as UTF-16 or UTF-32 (what Windows editors and PowerShell's ``>`` write) carries a byte-order mark:
it is decoded by that mark, so it reads like its UTF-8 copy. UTF-8 text is read unchanged (its recorded text, and
so a recorded run's fingerprint, stay what they were).

YAML lets a mapping repeat a key and keeps the last value, so ``merge_method: linear`` followed by
``merge_method: slerp`` would merge with slerp and complain about slerp's needs: :class:`UniqueKeyLoader`, the
safe loader with that one difference, refuses a repeated key instead, naming both lines (keys brought in by a
``<<`` merge key may still be overridden, as YAML intends).
"""

from __future__ import annotations

import codecs
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

# Longest first: UTF-32-LE's mark begins with UTF-16-LE's.
_MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
          (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def decode_config(data: bytes) -> str:
    """The text of a config file's ``data``: UTF-16/32 by its byte-order mark, else UTF-8 (as read before).

    Raises UnicodeDecodeError for bytes that are neither."""
    for mark, codec in _MARKS:
        if data.startswith(mark):
            return data.decode(codec)
    return data.decode("utf-8")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives ``key`` twice, at 1-based lines ``first`` and ``again``."""

    def __init__(self, key: str, first: int, again: int) -> None:
        super().__init__(f"{key} is given twice, at lines {first} and {again}")
        self.key, self.first, self.again = key, first, again


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (:class:`DuplicateKeyError`)."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise DuplicateKeyError(key_node.value, seen[key_node.value], line)
            seen[key_node.value] = line
        return super().construct_mapping(node, deep=deep)


def anchor_holders(text: str) -> frozenset[str]:
    """The YAML paths (``x-common``, ``models[0].x``) of the mapping keys of the one document ``text`` whose value
    defines an anchor that an alias outside that value uses: removing such a key breaks the config, where
    removing any other unknown key changes nothing. Empty for text that is not one valid YAML document.

    A node's first appearance in document order is its anchor (YAML defines an anchor before its aliases), every
    later one an alias; the keys holding the anchor but not the alias are the holders."""
    if "&" not in text:  # no anchor (the text of nearly every config): nothing to compose
        return frozenset()
    try:
        roots = [n for n in yaml.compose_all(text, Loader=UniqueKeyLoader) if n is not None]
    except yaml.YAMLError:
        return frozenset()
    if len(roots) != 1:
        return frozenset()
    defined: dict[int, tuple[str | int, ...]] = {}
    holders: set[str] = set()
    stack: list[tuple[Node, tuple[str | int, ...]]] = [(roots[0], ())]
    while stack:  # pre-order, in document order: the stack takes each node's children last first
        node, path = stack.pop()
        anchor = defined.get(id(node))
        if anchor is not None:  # an alias: every key holding the anchor but not this alias holds it for others
            holders.update(_render(anchor[:depth]) for depth in range(1, len(anchor) + 1)
                           if anchor[:depth] != path[:depth] and isinstance(anchor[depth - 1], str))
            continue
        defined[id(node)] = path
        if isinstance(node, MappingNode):
            stack.extend((value, (*path, key.value if isinstance(key, ScalarNode) else str(key.value)))
                         for key, value in reversed(node.value))
        elif isinstance(node, SequenceNode):
            stack.extend((item, (*path, i)) for i, item in reversed(list(enumerate(node.value))))
    return frozenset(holders)


def _render(path: tuple[str | int, ...]) -> str:
    """``("models", 0, "x")`` as resumerge's errors write a YAML path: ``models[0].x``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
