"""What the user asked: the mergekit YAML (a merge or a multi-stage recipe), model references, parameters, and where
resumerge keeps its state.

Everything here is parsing and validation of text the user wrote; nothing reads a weight or touches OUT.

May import: errors.
"""

__all__ = [
    "hubtarget",
    "locations",
    "merge_config",
    "modelref",
    "params",
    "recipe",
    "version",
]
