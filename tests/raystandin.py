"""What the passes' Ray code asks of Ray itself, for tests that run actors in this process (no cluster): Ray's two
exception classes the driver maps, and ``get``/``put`` where each call's result is its own reference."""

from __future__ import annotations


class StandInRay:
    """Ray's module as :class:`~resumerge.forward.placing.rayactor.RayModels` uses it; tests that make actors too
    subclass it with ``remote``, ``nodes`` and ``kill``."""

    class exceptions:
        class RayError(Exception):
            pass

        class RayTaskError(RayError):
            cause: BaseException | None = None

    def get(self, refs: object) -> object:
        return refs

    def put(self, value: object) -> object:
        return value
