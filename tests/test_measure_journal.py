"""``measure`` journals under the state dir (``measures/<key>/journal``); a measurement an earlier version was killed
in kept its journal inside OUT_DIR (``.journal``): run again, that journal is moved under the state dir whole (the
same files, the same names) and the measurement resumes at the layer it reached; OUT_DIR keeps no journal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def _regmean(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two generated models under ``tmp_path`` (check's proof tests' shape), a RegMean config over them reading
    ``tmp_path/grams`` and a one-line text: (the second model, the config, the text)."""
    from check.test_proof import SPEC

    from resumerge.cli.modelgen import make_model

    a, b = make_model(tmp_path / "a", SPEC, seed=1), make_model(tmp_path / "b", SPEC, seed=2)
    config = tmp_path / "rm.yml"
    config.write_text(f"merge_method: regmean\nmodels:\n  - model: {a}\n  - model: {b}\n"
                      f"parameters:\n  grams: {tmp_path / 'grams'}\ndtype: float32\n")
    texts = tmp_path / "texts.txt"
    texts.write_text("The capital of France is Paris.\n")
    return b, config, texts


def test_a_finished_measurement_is_proved_by_the_bytes_it_read(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured again, a finished measurement is answered without reading a tensor while its models look as
    recorded, proved by hashing again where one was touched, and refused (exit 4, the file named) where a model
    holds other bytes than it was measured from, though its identity (sampled blocks) is the same."""
    pytest.importorskip("transformers")
    from proofedits import count_reads, edit_unsampled, trust_fresh_files

    from resumerge import api
    from resumerge.errors import PlanChangedError

    trust_fresh_files(monkeypatch)
    b, config, texts = _regmean(tmp_path)
    state = tmp_path / "state"
    first = api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=state))
    assert not first.reused
    read = count_reads(monkeypatch)
    again = api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=state))
    assert again.reused and read == [] and again.proof is None
    os.utime(b / "model.safetensors")
    touched = api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=state))
    assert read == [str(b / "model.safetensors")] and touched.proof is not None and "same bytes" in touched.proof
    file = edit_unsampled(b, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(PlanChangedError) as refused:
        api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=state))
    assert str(file) in str(refused.value) and "decoder layer 1" in str(refused.value)
    assert refused.value.exit_code == 4


def test_ctrl_c_stops_a_measurement_naming_its_folder_and_the_command_and_it_resumes_to_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in a measurement's pass is the driver's (resumerge.forward.job.driver), as a check's: InterruptedMerge
    (exit 3) saying what OUT_DIR holds and naming the command that continues it; run again, it resumes and writes
    the bytes an uninterrupted measurement writes."""
    pytest.importorskip("transformers")

    from resumerge import api
    from resumerge.errors import InterruptedMerge
    from resumerge.forward.job import layerpass

    _, config, texts = _regmean(tmp_path)
    whole = api.measure(config, tmp_path / "whole", texts=texts,
                        settings=api.Settings(state_dir=tmp_path / "state-whole"))
    reached: list[str] = []

    def ctrl_c_after_the_first_layer(point: str, **_: object) -> None:
        reached.append(point)
        if point == "after_measure_layer" and len(reached) == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(layerpass, "reach", ctrl_c_after_the_first_layer)
        with pytest.raises(InterruptedMerge) as caught:
            api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    assert f"the measurement into {tmp_path / 'grams'} was interrupted (2 layer file(s)" in str(caught.value)
    assert caught.value.resume_command == f"resumerge measure {config} {tmp_path / 'grams'} --texts {texts}"
    assert caught.value.exit_code == 3
    resumed = api.measure(config, tmp_path / "grams", texts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    assert not resumed.reused and resumed.files == whole.files
    written = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*.safetensors"))
    assert written == sorted(p.relative_to(tmp_path / "grams") for p in (tmp_path / "grams").rglob("*.safetensors"))
    for name in (*written, Path("measure.json")):
        assert (tmp_path / "grams" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
