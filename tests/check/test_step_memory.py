"""A check's largest step as its pass holds it (issue 72): a float32 model's tensors, which the reader hands over as
the file's own map, are counted once — at 1.20 GB ``check --max-memory 600MB`` was refused asking for 796 MB, the
113 MB embedding table counted a second time for its read, and twice again for the folded static pass, which keeps
the base's decoder layers, never its embeddings — and at the smallest budget it names, the check runs within it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support import peak_rss_run

from resumerge.machine.memory import parse_size

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")


def _figure(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, text
    return parse_size(found[1])


@linux_only
def test_the_embeddings_are_counted_once_and_the_check_stays_within_the_budget_it_names(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from resumerge.cli.modelgen import ModelSpec, make_model

    # the embeddings (16.8 MB) the largest step by far: two short texts, layers of 1 MB
    spec = ModelSpec(layers=2, hidden=256, intermediate=64, vocab=16384, shard_bytes=1 << 30)
    merge, base, parent = (make_model(tmp_path / name, spec, seed=seed) for seed, name in enumerate("mbp", 1))
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na merge of two models\n", encoding="utf-8")
    embeddings = spec.vocab * spec.hidden * 4
    check = [sys.executable, "-m", "resumerge", "check", str(merge), "--base", str(base), "--parent", str(parent),
             "--prompts", str(texts), "--state-dir", str(tmp_path / "state"), "--json"]

    code, _, refused = peak_rss_run([*check, "--max-memory", "1MB"])
    assert code == 2 and refused.count("\n") == 1, refused
    step = _figure(r"its largest step ([\d.]+ ?[kMG]?B)", refused)
    assert embeddings <= step < 1.5 * embeddings, refused  # counted twice: 2 x 16.8 MB
    named = _figure(r"rerun with --max-memory (\S+) or more", refused)

    code, peak, err = peak_rss_run([*check, "--max-memory", str(named)])
    assert code in (0, 5, 6), err
    assert peak <= named, f"peak {peak:,} over the budget of {named:,} the check named"
