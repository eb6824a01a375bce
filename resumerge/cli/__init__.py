"""The command line and the terminal: argument parsing, one library call per command, and the only module that imports
rich (``render``).

``resumerge demo`` and the tiny-model generator it uses live here too. A notebook calls the same library
functions through :mod:`resumerge.api`.

May import: errors, config, memory, store, plan, engine.
"""

__all__ = [
    "commands",
    "demo",
    "knobs",
    "modelgen",
    "recipes",
    "render",
]
