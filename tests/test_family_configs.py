"""No family's merge writes a config transformers reads differently from its inputs' (issue 96): for every family
the tests build, transformers' ``AutoConfig`` of a linear merge of two models equals the inputs' in every key but
the dtype and the writing transformers' version: ``tie_word_embeddings`` (DeepSeek-V4's merge said true where its
inputs said false, its head being ``head.weight``), ``vocab_size``, the layer count and every per-layer list."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deepseek_v4_models import FAMILIES as V4
from deepseek_v4_models import make_v4_model
from families import FAMILIES, make_family_model
from family_table import TABLE, make_table_model
from moe_families import MOE_FAMILIES, make_moe_model
from newest_families import NEWEST
from support import api_merge

pytest.importorskip("transformers")

# what a merge may change: the dtype it writes and the transformers that wrote the file
_IGNORED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")

Maker = Callable[[Path, int], Path]
MAKERS: dict[str, Maker] = {
    **{f"family-{f.name}": (lambda d, s, f=f: make_family_model(d, f, s)) for f in FAMILIES},
    **{f"moe-{t}": (lambda d, s, t=t: make_moe_model(d, t, s)) for t in MOE_FAMILIES},
    **{f: (lambda d, s, f=f: make_table_model(d, f, s)) for f in (*TABLE, *NEWEST)},
    **{f: (lambda d, s, f=f: make_v4_model(d, f, s)) for f in V4},
}


def _read(directory: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    found = AutoConfig.from_pretrained(directory).to_dict()
    return {k: v for k, v in found.items() if k not in _IGNORED}


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_transformers_reads_a_merges_config_as_its_inputs(family: str, tmp_path: Path) -> None:
    make = MAKERS[family]
    a, b = make(tmp_path / "a", 1), make(tmp_path / "b", 2)
    out = api_merge(tmp_path, {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})
    theirs, ours = _read(a), _read(out)
    assert _read(b) == theirs
    assert {k: v for k, v in ours.items() if theirs.get(k) != v} == {}
    assert set(ours) == set(theirs)
