"""What a mergekit-moe run's prompt forward pass leaves for other commands to read, without torch (``resumerge
status`` stays quick): its folders under the state dir, one per pass (named by its content key), each holding a
file per decoder layer done until the pass writes its routers and deletes them. :mod:`resumerge.moe.forward`
writes them; :mod:`resumerge.store.statusview` reads them.

May import: the standard library only.
"""

from __future__ import annotations

from pathlib import Path

# Under the state dir: the forward passes, each in a folder named by its content key.
ROUTERS_DIR = "moe-routers"
# A finished pass's routers, and the per-layer files of one under way.
ROUTERS_NAME = "routers.safetensors"
LAYER_PREFIX = "layer-"


def passes_under_way(state_root: Path) -> list[int]:
    """The layers done by each unfinished forward pass in the state dir ``state_root`` (a pass journals every
    layer the moment it is done)."""
    found = []
    for workdir in sorted((state_root / ROUTERS_DIR).glob("*")):
        if workdir.is_dir() and not (workdir / ROUTERS_NAME).exists():
            found.append(sum(1 for _ in workdir.glob(f"{LAYER_PREFIX}*.safetensors")))
    return found
