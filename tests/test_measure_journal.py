"""``measure`` journals under the state dir (``measures/<key>/journal``); a measurement an earlier version was killed
in kept its journal inside OUT_DIR (``.journal``): run again, that journal is moved under the state dir whole (the
same files, the same names) and the measurement resumes at the layer it reached; OUT_DIR keeps no journal."""

from __future__ import annotations

from pathlib import Path

from resumerge.analyses.measure.passes import HIDDEN, JOURNAL, workdir_of


def test_an_earlier_versions_journal_in_out_dir_is_moved_under_the_state_dir(tmp_path: Path) -> None:
    out, workdir = tmp_path / "grams", tmp_path / "state" / "measures" / "k"
    old = out / JOURNAL / "model-01"
    old.mkdir(parents=True)
    (old / "hidden-00000.safetensors").write_bytes(b"layer 0's hidden states")
    assert workdir_of(out, workdir) == workdir
    moved = workdir / HIDDEN / "model-01" / "hidden-00000.safetensors"
    assert moved.read_bytes() == b"layer 0's hidden states"
    assert not (out / JOURNAL).exists()
    # Where the state dir holds a journal already (this version's, the newer), OUT_DIR's is dropped.
    stale = out / JOURNAL / "model-00"
    stale.mkdir(parents=True)
    assert workdir_of(out, workdir) == workdir
    assert not (out / JOURNAL).exists() and moved.is_file() and not (workdir / HIDDEN / "model-00").exists()
    fresh = tmp_path / "state" / "measures" / "j"
    assert workdir_of(tmp_path / "fresh", fresh) == fresh and not fresh.exists()  # made by the pass, not here
