"""The static pass folded into the forward pass's reads of the decoder layers: each model's layer is read once, for
its forward, and its tensors' static figures are taken from those same values, not from a second read of every
model (that second read was a fifth of a check of a 1 GB model and its parents: bench/RESULTS.md, issue 57).

In each layer the base runs first and its tensors are kept until the layer's last model has run (one layer more
held: the layer step reserves two); the merge's and each parent's tensors are compared with the base's as they
are read, by :func:`~resumerge.analyses.check.static.squared` over the same blocks in the same order as the static
pass's spans, so every figure is the same to the bit. A tensor not seen whole in a layer (one some model's modules do
not read) is left to the static pass, which reads it after the forward pass, as it reads the tensors outside the
decoder layers (embeddings, final norm, head) before it. What was found is journaled with each layer's hidden
states (:meth:`FoldedStatic.to_json`), so a resumed check has it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from resumerge.analyses.check.static import TensorResult, all_finite, compared_with, difference_buffer, squared
from resumerge.forward.engine.reader import CastReader
from resumerge.machine.torch_import import torch


class FoldedStatic:
    """The static figures of the tensors the forward pass reads: ``roles`` the models' (the merge first),
    ``shapes`` their logical tensors' shapes (:func:`~resumerge.analyses.check.static.logical_shapes`)."""

    def __init__(self, roles: Sequence[str], shapes: list[dict[str, tuple[int, ...]]]) -> None:
        self.roles, self.shapes = list(roles), shapes
        self.base = self.roles.index("base") if "base" in self.roles else None
        self.found: dict[str, TensorResult] = {}
        self._kept: dict[str, torch.Tensor] = {}  # the base's tensors of the layer running
        self._partial: dict[str, dict[int | str, float | bool]] = {}
        self._scratch = difference_buffer()

    def order(self) -> list[int]:
        """The order the models run in within a layer: the base first (its tensors are what the others are
        compared with), then the others as given."""
        n = len(self.roles)
        return [i for i in range(n) if i == self.base] + [i for i in range(n) if i != self.base]

    @contextmanager
    def watching(self, reader: CastReader, model: int) -> Iterator[None]:
        """Take the static figures of what ``reader`` (of model ``model``) reads in the block."""
        reader.watch = lambda name, values: self._seen(model, name, values)
        try:
            yield
        finally:
            reader.watch = None

    def _seen(self, model: int, name: str, values: torch.Tensor) -> None:
        if name not in self.shapes[0] or name in self.found:
            return
        others = compared_with(self.shapes, self.roles, name)
        part = self._partial.setdefault(name, {})
        if model == self.base and others is not None:
            self._kept[name] = values
            part[model] = squared(values)
        elif others is not None and (model == 0 or model in others) and name in self._kept:
            part[model] = squared(values, self._kept[name], scratch=self._scratch)
        if model == 0:  # ‖M−B‖² finite: every M−B is, so every value of M is (inf or NaN in M would not be)
            moved = part.get(0)
            part["finite"] = (moved is not None and math.isfinite(moved)) or all_finite(values)

    def end_layer(self) -> None:
        """The layer's last model has run: keep the figures of every tensor seen whole, drop the base's tensors."""
        for name, part in self._partial.items():
            if "finite" not in part:
                continue
            finite = bool(part["finite"])
            others = compared_with(self.shapes, self.roles, name)
            if others is None:
                self.found[name] = (finite, None)
            elif self.base is not None and all(i in part for i in (0, self.base, *others)):
                self.found[name] = (finite, [float(part[i]) for i in (0, *others, self.base)])
        self._partial.clear()
        self._kept.clear()

    def nonfinite(self) -> bool:
        """Whether a tensor of the merge seen so far holds a non-finite value (the check is broken: no need to
        run on)."""
        return any(not finite for finite, _ in self.found.values())

    def to_json(self) -> str:
        """What was found, for the journal (floats as Python writes them: read back to the bit)."""
        return json.dumps({name: [finite, sums] for name, (finite, sums) in sorted(self.found.items())})

    def restore(self, text: str) -> None:
        """What :meth:`to_json` wrote, found again (a resumed check)."""
        self.found = {name: (bool(finite), None if sums is None else [float(v) for v in sums])
                      for name, (finite, sums) in json.loads(text).items()}
