"""A native model's layer run on its own hidden states and on the reference's input as one batch of twice the
sequences (:func:`resumerge.forward.placement.stacks`) gives every figure of the check to the bit as the two runs
apart did: the NLLs, KLs, drift, departures and spread of a merge, its base and two parents, over padded batches
(and a sliding window reached: Gemma 2's eager attention); a family the native modules do not
build is never stacked; and the next layer's bytes are asked of the kernel while a layer runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.passes import PassFigures, forward_pass, streams_of
from resumerge.config.modelref import ModelRef
from resumerge.forward import placement
from resumerge.inputs.model import open_model

pytest.importorskip("transformers")

from families import FAMILIES, make_family_model

# padded (three lengths in one batch), longer than the Gemma 2 family's window (16)
TOKENS = [[1, 5, 9, 33, 70, 2, 11, 100, 4, 6, 7] * 4, [1, 44, 3, 90], [7, 8, 9, 10, 11, 12, 13] * 3]
ROLES = ("merge", "base", "parent", "parent")


def _models(tmp_path: Path, name: str) -> list[Checked]:
    family = next(f for f in FAMILIES if f.name == name)
    found = []
    for seed, role in enumerate(ROLES):
        folder = make_family_model(tmp_path / f"{role}{seed}", family, seed)
        found.append(Checked(role, str(folder), None, open_model(ModelRef(str(folder)), directory=folder)))
    return found


def _figures(models: list[Checked], workdir: Path) -> tuple[PassFigures | None, list[bool]]:
    streams = streams_of(models)
    try:
        return forward_pass(models, streams, TOKENS, workdir), [placement.stacks(s) for s in streams]
    finally:
        for stream in streams:
            stream.close()


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_stacked_layers_give_the_figures_of_the_layers_run_apart(tmp_path: Path, name: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    models = _models(tmp_path, name)
    stacked, used = _figures(models, tmp_path / "stacked")
    monkeypatch.setattr(placement, "STACKING", False)
    apart, _ = _figures(models, tmp_path / "apart")
    assert stacked is not None and stacked == apart
    assert used == [name != "gpt2"] * len(models)  # GPT-2: transformers' modules, run as before
    assert all(d > 0 for d in stacked.depart[1]) and stacked.spread[-1] > 0  # the stacked halves were compared


def test_the_next_layer_is_asked_of_the_kernel_while_a_layer_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    models = _models(tmp_path, "llama")[:2]
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
