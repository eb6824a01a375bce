"""What the user asked: the mergekit YAML of one merge, model references, parameters, and where
resumerge keeps its state.

Everything here is parsing and validation of text the user wrote (and the tables of the output formats ``--out-type``
names, :mod:`.outformats`, of the executors ``--executor`` names, :mod:`.passplace`, which the CLI's parser reads, and
of the analyses, :mod:`.analyses`, which the CLI's commands and the API's names are built from); nothing reads a
weight or touches OUT. A multi-stage recipe is parsed in :mod:`resumerge.runs.recipes.recipe`, from the documents
parsed here.

May import: errors.
"""

__all__ = [
    "analyses",
    "hubtarget",
    "locations",
    "merge_config",
    "modelref",
    "outformats",
    "params",
    "passplace",
    "settings",
    "version",
    "yamldiff",
    "yamltext",
]
