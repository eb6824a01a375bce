"""What transformers answers about a stack of slices' configs (per-layer keys, packed tables, the output's build
check) kept in resumerge's cache per installation: a second plan of the same configs asks transformers nothing
(its import and torch's were most of a DELLA slice's start-up), a changed installation or config asks again, and
only answers transformers gave are kept."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resumerge.merge.plan import buildcheck, keptfacts, layerfacts, packing
from resumerge.merge.plan.buildcheck import NOT_BUILT, check_built
from resumerge.merge.plan.layerfacts import class_per_layer_keys
from resumerge.merge.plan.packing import packed_tables

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64}


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache, and no answer of this process's earlier plans."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    packing._packed.cache_clear()
    layerfacts._class_keys.cache_clear()
    yield tmp_path / "resumerge" / "transformers-facts"
    packing._packed.cache_clear()
    layerfacts._class_keys.cache_clear()


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[object]:
    calls: list[object] = []
    inner = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: calls.append(args) or inner(*args))
    return calls


def test_a_second_plan_of_the_same_configs_asks_transformers_nothing(cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    builds, keys = _counting(monkeypatch, packing, "_built"), _counting(monkeypatch, layerfacts, "_found_keys")
    checks = _counting(monkeypatch, buildcheck, "build_meta")
    stack = (("a", 1), ("a", 0))
    first = (packed_tables(LLAMA), class_per_layer_keys("llama"),
             check_built(LLAMA, {"a": LLAMA}, "a", stack, {}, lambda i: "slices"))
    assert first == ({}, frozenset(), []) and len(builds) == 1 and len(keys) == 1 and len(checks) == 1
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["built", "packed", "per"]
    # a new process (nothing found in this one's memory): every answer read back, nothing built again
    packing._packed.cache_clear()
    layerfacts._class_keys.cache_clear()
    again = (packed_tables(dict(LLAMA)), class_per_layer_keys("llama"),
             check_built(LLAMA, {"a": LLAMA}, "a", stack, {}, lambda i: "slices"))
    assert again == first and len(builds) == 1 and len(keys) == 1 and len(checks) == 1
    # another stack, another config, another transformers: asked again
    assert check_built(LLAMA, {"a": LLAMA}, "a", (("a", 1), ("a", 1)), {}, lambda i: "slices") == []
    assert len(checks) == 2
    assert packed_tables({**LLAMA, "hidden_size": 32}) == {} and len(builds) == 2
    monkeypatch.setattr(packing, "installed", lambda: ("0.0.1", "0.0.1", "/nowhere/transformers/__init__.py"))
    assert packed_tables(LLAMA) == {} and len(builds) == 3


def test_a_torn_answer_is_found_again_and_a_missing_transformers_is_never_answered_from_the_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    builds = _counting(monkeypatch, packing, "_built")
    assert packed_tables(LLAMA) == {} and len(builds) == 1
    (kept,) = cache.iterdir()
    kept.write_text('{"answer": [["model.embed', encoding="utf-8")  # a torn write
    packing._packed.cache_clear()
    assert packed_tables(LLAMA) == {} and len(builds) == 2
    assert keptfacts.kept("packed", ["?"], ("1", "2")) == (False, None)
    # transformers missing (its import fails): nothing is read back, as nothing would be built
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert keptfacts.installed() is None
    layerfacts._class_keys.cache_clear()
    assert class_per_layer_keys("llama") is None
    assert check_built(LLAMA, {"a": LLAMA}, "a", (("a", 1), ("a", 0)), {}, lambda i: "slices") == [NOT_BUILT]


def test_a_family_transformers_cannot_build_is_not_kept(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _counting(monkeypatch, layerfacts, "_found_keys")
    assert class_per_layer_keys("no-such-family") is None
    layerfacts._class_keys.cache_clear()
    assert class_per_layer_keys("no-such-family") is None and len(keys) == 2
    assert not cache.exists() or not any(cache.iterdir())
