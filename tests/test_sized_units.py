"""A run sizes each class of tensors once (issue 87 item 15): the pipeline's mode and admitted estimate of a tensor
(``unit_mode``, ``unit_bytes``) are worked out once per class of equal sizing keys, not asked again of every
tensor. A 90k-tensor run asked them of every tensor, two estimates each: 180k of its 240k estimates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.modelgen import make_model
from resumerge.merge.plan import workunits
from tests.manylayers import many_layer_spec
from tests.support import digests, linear_config


def _counted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layers: int,
                 weights: tuple[object, object]) -> tuple[int, dict[str, str]]:
    """(estimate_bytes calls, output digests) of a linear run of two ``layers``-layer models in this process."""
    spec = many_layer_spec(layers)
    root = tmp_path / f"l{layers}-{abs(hash(str(weights)))}"
    a, b = make_model(root / "a", spec, seed=1), make_model(root / "b", spec, seed=2)
    calls = [0]
    inner: Callable[..., int] = workunits.estimate_bytes

    def counted(*args: Any, **kwargs: Any) -> int:
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(workunits, "estimate_bytes", counted)
    try:
        api.run(yaml.safe_dump(linear_config(a, b, weights=weights)), root / "out",
                settings=api.Settings(state_dir=root / "state"))
    finally:
        monkeypatch.undo()
    return calls[0], digests(root / "out")


def test_estimates_do_not_grow_with_tensors_of_one_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three times the layers of one kind (every layer's tensors alike): the same estimates, not three times as
    many; the smallest budget and the pipeline each size a class once."""
    few, _ = _counted_run(tmp_path, monkeypatch, 4, (0.3, 0.7))
    many, _ = _counted_run(tmp_path, monkeypatch, 12, (0.3, 0.7))
    assert few == many, (few, many)


def test_estimates_per_class_with_per_layer_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-layer weights (a gradient) make a class of each layer's tensors of one shape: at most a few estimates per
    class (the smallest budget's two, the pipeline's mode and unit): fewer than two per tensor, as many in a
    second run of the same config, and its weights the same bytes."""
    layers = 12
    calls, got = _counted_run(tmp_path, monkeypatch, layers, ([0.2, 0.8], 0.5))
    tensors = 9 * layers + 3
    assert calls < 2 * tensors, (calls, tensors)
    again, same = _counted_run(tmp_path / "again", monkeypatch, layers, ([0.2, 0.8], 0.5))
    assert again == calls
    weights = {name: digest for name, digest in got.items() if name.endswith(".safetensors")}
    assert weights and weights == {name: same[name] for name in weights}
