"""One run's shared objects, handed to every unit of that run through :attr:`MergeContext.resources`.

A registered function stays a function of its context: what several units of one run share (MoE upcycling's
routers from the prompt forward pass, a LoRA extraction's factor pairs and their on-disk cache) is an object the
run's planning makes and the engine passes along, as httpx passes ``extensions`` and sd-mecha its per-key cache —
never a module global, so two runs in one process (a notebook) never see each other's. A function finds its
object by type; the engine does not know what the objects are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Resources:
    """The shared objects of one run (at most one of each type), found with :meth:`find`."""

    objects: tuple[object, ...] = ()

    def find(self, kind: type[T]) -> T | None:
        """The run's object of type ``kind`` (or of a subclass), or None when the run has none."""
        for item in self.objects:
            if isinstance(item, kind):
                return item
        return None

    def adding(self, *objects: object) -> Resources:
        """These resources and ``objects`` too."""
        return Resources(self.objects + objects)


# A context without a run's objects: the timing of ``plan``, a test calling a function on its own.
NO_RESOURCES = Resources()
