"""A size target's run (``--gguf-target-bpw`` / ``--gguf-target-size``, issue 95) stays within the smallest
``--max-memory`` ``plan`` names: its importance pass encodes each decoder matrix at every candidate type (the 1- to
8-bit K- and i-quants, weighted) in the run's process, loading all their kernels and the i-quants' tables, and the
merge after it encodes the chosen types there; ``plan``, the pass's admission and the merge's guard count those
kernels in their baselines, one figure. Before, ``plan`` counted the mix's (``--gguf-type q4_k_m``'s) kernels alone:
a run at its smallest budget (439 MB) computed the whole pass, peaking at 501 MB, then refused the merge after it
(exit 2, "needs a budget of 529 MB"); on another installation's measurements it finished, at 531 MB of 496."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ggufmodels import linear_llama_pair
from support import cli, peak_rss_run
from test_imatrix_merge import TEXTS

pytest.importorskip("numba")  # without it the encoders are numpy's: no kernels to count


def test_a_size_target_run_at_the_smallest_budget_plan_names_stays_within_it(tmp_path: Path) -> None:
    """At ``plan``'s smallest budget the run (its pass measuring every candidate type, then the merge of the types
    chosen) finishes and its process's peak RSS is within that budget; 1 MB under it is refused (exit 2) before the
    pass: no matrix, no OUT."""
    (tmp_path / "merge").mkdir()
    config, texts = linear_llama_pair(tmp_path / "merge", TEXTS)
    out, state = tmp_path / "out", tmp_path / "state"
    args = (config, out, "--state-dir", state, "--out-type", "gguf", "--gguf-type", "q4_k_m", "--gguf-target-bpw",
            "4.5", "--imatrix-texts", texts)
    planned = cli("plan", *args, "--json", timeout=900)
    assert planned.returncode == 0, planned.stderr
    smallest = json.loads(planned.stdout)["memory"]["smallest_budget"]
    refused = cli("run", *args, "--max-memory", f"{(smallest - 1_000_000) // 1000}kB", timeout=900)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    assert not out.exists() and not list((state / "imatrix").glob("*.gguf")), list(state.rglob("*"))
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", *map(str, args), "--max-memory",
                                    f"{smallest // 1000}kB"], timeout=1800)
    assert code == 0, err
    assert peak <= smallest, (peak, smallest)


def test_a_wide_mlp_size_target_run_stays_within_the_smallest_budget_plan_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose MLP is wide (16,416 of 64 columns, one layer) on eight texts of 480 tokens: the pass holds,
    beside the layer and the hidden states ``plan`` counted, the products of the two texts running at once (three of
    the MLP's width, and the float64 copy of the down projection's input its sums square: 24 bytes of 16,416 a
    token), then, measuring each matrix's costs, a chunk's copies (a million values, float64) and the layer run
    again with a matrix quantized. ``plan`` named 477 MB; the run at it peaked at 739 MB. Now ``plan``, the pass's
    admission and its layers' reservations count them (``onmerge.texts_held``): the run's peak is within the figure."""
    import ggufmodels

    for name, value in (("HIDDEN", 64), ("HEAD_DIM", 16), ("FF", 16_416), ("LAYERS", 1)):
        monkeypatch.setattr(ggufmodels, name, value)
    root = tmp_path / "merge"
    root.mkdir()
    config = ggufmodels.linear_llama_config(root)
    texts = root / "texts.txt"
    texts.write_text("".join(" ".join(["the cat sat on a mat"] * 24) + "\n" for _ in range(8)))
    args = (config, tmp_path / "out", "--state-dir", tmp_path / "state", "--out-type", "gguf", "--gguf-type",
            "q4_k_m", "--gguf-target-bpw", "5.5", "--imatrix-texts", texts)
    planned = cli("plan", *args, "--json", timeout=900)
    assert planned.returncode == 0, planned.stderr
    smallest = json.loads(planned.stdout)["memory"]["smallest_budget"]
    code, peak, err = peak_rss_run([sys.executable, "-m", "resumerge", "run", *map(str, args), "--max-memory",
                                    f"{smallest // 1000}kB"], timeout=1800)
    assert code == 0, err
    assert peak <= smallest, (peak, smallest)
