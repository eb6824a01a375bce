"""The forward pass asks the kernel for the next layer's bytes while a layer runs
(:meth:`resumerge.forward.engine.reader.CastReader.prefetch`): the next model's layer, else the next layer's first
model's, and of each file only the span of that layer's tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumerge.analyses.check.models import Checked
from resumerge.config.modelref import ModelRef
from resumerge.forward.compared.passes import forward_pass, streams_of
from resumerge.inputs.model import open_model

pytest.importorskip("transformers")

from families import FAMILIES, make_family_model

TOKENS = [[1, 5, 9, 33, 70, 2, 11, 100, 4, 6, 7] * 4, [1, 44, 3, 90], [7, 8, 9, 10, 11, 12, 13] * 3]
ROLES = ("merge", "base")


def _models(tmp_path: Path, name: str) -> list[Checked]:
    family = next(f for f in FAMILIES if f.name == name)
    found = []
    for seed, role in enumerate(ROLES):
        folder = make_family_model(tmp_path / f"{role}{seed}", family, seed)
        found.append(Checked(role, str(folder), None, open_model(ModelRef(str(folder)), directory=folder)))
    return found


def test_the_next_layer_is_asked_of_the_kernel_while_a_layer_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    models = _models(tmp_path, "llama")
    asked: list[tuple[str, str]] = []
    streams = streams_of(models)
    for stream in streams:
        def prefetch(prefix: str, key: str = str(stream.reader.directory.name)) -> None:
            asked.append((key, prefix))
        monkeypatch.setattr(stream.reader, "prefetch", prefetch)
    try:
        forward_pass(models, streams, TOKENS, tmp_path / "journal")
    finally:
        for stream in streams:
            stream.close()
    layers = streams[0].layers
    # the base's layer asked for while the merge's runs, the merge's next layer while the base's runs
    expected = [step for i in range(layers) for step in (("base1", f"model.layers.{i}."),
                                                          ("merge0", f"model.layers.{i + 1}."))]
    assert asked == expected[:-1]


def test_a_layer_s_prefetch_asks_for_its_bytes_in_each_file_and_nothing_else(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    model = _models(tmp_path, "llama")[0]
    asked: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, length, advice: asked.append((start, length, advice)))
    (stream,) = streams_of([model])
    try:
        stream.reader.prefetch("model.layers.1.")
    finally:
        stream.close()
    spans = [(t.entry.start, t.entry.end) for name, t in model.opened.tensors.items()
             if name.startswith("model.layers.1.")]
    files = {t.file for name, t in model.opened.tensors.items() if name.startswith("model.layers.1.")}
    assert len(asked) == len(files) and {a for _, _, a in asked} == {os.POSIX_FADV_WILLNEED}
    covered = [(start, start + length) for start, length, _ in asked]
    assert all(any(a <= s and e <= b for a, b in covered) for s, e in spans)
    assert sum(e - s for s, e in covered) < sum(t.entry.end - t.entry.start for t in model.opened.tensors.values())
