"""What a mergekit-moe run's prompt forward pass leaves for other commands to read, without torch (``resumerge
status`` stays quick): its folders under the state dir, one per pass (named by its content key), each holding a
file per decoder layer done until the pass writes its routers and deletes them (the folder of them all is a
location: :data:`~resumerge.config.locations.ROUTERS_DIR`). :mod:`resumerge.runs.moe.forward` writes them; the MoE
kind's ``status`` reads them. Standard library only, with the locations.
"""

from __future__ import annotations

from pathlib import Path

from resumerge.config.locations import ROUTERS_DIR

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
