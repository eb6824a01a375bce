"""What an extraction asks of transformers' modules is kept in resumerge's cache: an extraction or its resume with the
answer kept never imports transformers, and the kept answer is the built one (a torn file is built again, another
transformers version is asked again, nothing is kept where transformers gives no answer)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from resumerge.errors import UsageError
from resumerge.merge.plan.expertmodules import meta_model
from resumerge.runs.extract import modelview
from resumerge.runs.extract.loadable import check_loadable
from resumerge.runs.extract.modelview import model_modules
from resumerge.runs.extract.peftview import peft_view


def _kept(cache: Path) -> list[Path]:
    return sorted((cache / "transformers-facts").glob("module-views-*.json"))


def test_the_kept_answer_is_the_built_one(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    base, _ = pair("qwen2-tied-bf16")
    config = json.loads((base / "config.json").read_text())
    built = model_modules(config, tmp_path)
    assert built is not None and len(_kept(tmp_path)) == 1
    model, _, renames = meta_model(config)  # type: ignore[misc]
    assert built.paths == {n for n, _ in model.named_modules()}
    assert built.kinds["lm_head"] == ("Linear", True) and built.kinds["model.embed_tokens"] == ("Embedding", True)
    assert built.kinds["model.layers.0.mlp"][1] is False
    assert "model.embed_tokens" in built.embeddings
    assert [(p.pattern, t) for p, t in built.patterns()] == [(p.pattern, t) for p, t in renames]
    assert model_modules(config, tmp_path) == built  # read back
    (path,) = _kept(tmp_path)
    path.write_text(path.read_text()[:50])  # torn: built again, and kept whole
    assert model_modules(config, tmp_path) == built
    assert json.loads(path.read_text())["answer"]["paths"] == sorted(built.paths)
    assert not list(path.parent.glob("*.part"))


def test_another_transformers_or_none_is_asked_again(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = pair("llama")
    config = json.loads((base / "config.json").read_text())
    built = model_modules(config, tmp_path)
    monkeypatch.setattr(modelview, "installed", lambda: ("0.0.1", "0.0.1", "/nowhere/transformers/__init__.py"))
    assert model_modules(config, tmp_path) == built and len(_kept(tmp_path)) == 2
    assert model_modules({**config, "model_type": "no-such-family"}, tmp_path) is None
    assert len(_kept(tmp_path)) == 2  # no answer: nothing kept
    with pytest.raises(UsageError, match="not a linear, embedding or convolution layer"):
        check_loadable(config, [("model.layers.0.mlp", "model.layers.0.mlp")])
    monkeypatch.setattr(modelview, "installed", lambda: None)  # not installed
    assert model_modules(config, tmp_path) is None
    assert peft_view(config).paths == frozenset()
    check_loadable(config, [("model.layers.0.mlp", "model.layers.0.mlp")])  # nothing asked: nothing refused


_EXTRACT_AND_LOOK = """
import sys
from resumerge.cli.commands import main
code = main(sys.argv[1:])
print(code, "transformers" in sys.modules)
"""


def test_an_extraction_with_the_answer_kept_never_imports_transformers(
        tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    base, ft = pair("llama")
    args = ["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(tmp_path / "out"),
            "--max-rank", "4", "--state-dir", str(tmp_path / "state"), "-q"]
    assert model_modules(json.loads((base / "config.json").read_text())) is not None  # kept in the session's cache
    done = subprocess.run([sys.executable, "-c", _EXTRACT_AND_LOOK, *args], capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.stdout.split() == ["0", "False"], done.stderr
