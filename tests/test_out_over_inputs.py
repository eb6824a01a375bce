"""A run never writes where it reads (issue 60, item 2): an OUT that is, or holds, an input model's folder or one of
its files is refused (exit 2, one line) when the plan is made, by every kind of run, ``plan`` and every recipe stage,
before anything is deleted; ``--restart`` had deleted the input's weights, config and tokenizer. The sink never
deletes a file the run reads, whatever decided it (the second line). The refusals are driven through the CLI as a
user would meet them; the runs that make the inputs, or that succeed, run in this process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from conftest import ModelFactory
from support import cli, linear_config, write_config

from resumerge import api
from resumerge.errors import ResumergeError, UsageError, exit_code_for
from resumerge.merge.engine import drive

_IS = "is the folder of the input"


def _files(*folders: Path) -> dict[str, str]:
    """sha256 of every file under ``folders`` (links followed), by path."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for folder in folders
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _merged(tmp_path: Path, make: ModelFactory, name: str) -> Path:
    """A model folder that resumerge wrote (its manifest lets ``--restart`` clean it): the input to protect. Made
    in this process (the refusals are what goes through the CLI)."""
    out = tmp_path / name
    api.run(write_config(tmp_path / f"{name}.yml", linear_config(make("a", seed=1), make("b", seed=2))), out)
    return out


def _refused_here(error: ResumergeError, words: str) -> None:
    """What ``_refused`` checks of the CLI's line (``error: `` and this one line, exit 2), of the error raised."""
    line = error.one_line()
    assert exit_code_for(error) == 2 and "\n" not in line and words in line, line
    assert "write the output to a new folder outside the inputs' folders" in line


def _refused(done: object, words: str) -> None:
    stderr = getattr(done, "stderr", "")
    assert getattr(done, "returncode", None) == 2, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and words in stderr, stderr
    assert "write the output to a new folder outside the inputs' folders" in stderr


@pytest.mark.parametrize("kind", ["merge", "adapter", "moe", "extraction"])
def test_an_out_that_is_an_input_is_refused_before_anything_is_deleted(tmp_path: Path, make: ModelFactory,
                                                                       kind: str) -> None:
    # The input is a folder resumerge wrote (a manifest, so --restart cleaned the files it had planned: the input's
    # weights, config.json and tokenizer), named through a link so that only real paths can tell.
    model = _merged(tmp_path, make, "model")
    a, b = make("a", seed=1), make("b", seed=2)
    link = tmp_path / "link"
    link.symlink_to(model)
    if kind == "extraction":
        args = ["extract-lora", "--model", str(link), "--base-model", str(a), "--out-path", str(model)]
    else:
        if kind == "merge":
            doc = linear_config(a, link)
        elif kind == "adapter":  # model: BASE+ADAPTER, the adapter being the folder written to
            api.extract_lora(str(b), str(a), tmp_path / "lora", lora=api.Lora(max_rank=4))
            model = tmp_path / "lora"
            link.unlink()
            link.symlink_to(model)
            doc = linear_config(a, Path(f"{a}+{link}"))
        else:
            doc = {"base_model": str(a), "gate_mode": "random",
                   "experts": [{"source_model": str(link)}, {"source_model": str(b)}]}
        config = write_config(tmp_path / "over.yml", doc)
        with pytest.raises(ResumergeError) as planned:  # plan's refusal: `resumerge plan` is this call
            api.estimate(config, model, probe_size=0)
        assert exit_code_for(planned.value) == 2
        args = ["run", str(config), str(model)]
    before = _files(model, a, b)
    _refused(cli(*args, "--restart"), _IS)  # through the CLI once, as a user meets it
    with pytest.raises(ResumergeError) as refused:  # without --restart: the same refusal, in this process
        if kind == "extraction":
            api.extract_lora(str(link), str(a), model)
        else:
            api.run(config, model)
    _refused_here(refused.value, _IS)
    assert _files(model, a, b) == before


def test_an_out_that_holds_an_input_is_refused(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a", seed=1)
    # A new OUT holding an input's folder: "not empty and was not written by resumerge" (exit 4) said nothing of it.
    outer = tmp_path / "outer"
    inner = make("../outer/inner", seed=3).resolve()
    config = write_config(tmp_path / "inner.yml", linear_config(a, inner))
    before = _files(inner)
    _refused(cli("run", config, outer, "--restart"), f"OUT contains the folder ({inner}) of the input")
    assert _files(inner) == before
    assert not outer.joinpath("resumerge-manifest.json").exists() and sorted(outer.iterdir()) == [inner]


def test_an_out_inside_an_input_folder_is_allowed(tmp_path: Path, make: ModelFactory) -> None:
    # model: ./m, OUT ./m/merged: the input is read from its own files, never its subfolders, and nothing resumerge
    # writes or deletes lies outside OUT; a --restart over a different run there leaves the input alone too.
    a, m = make("a", seed=1), make("m", seed=2)
    before = {name: sha for name, sha in _files(m).items() if "/merged/" not in name}
    for weights in ((0.3, 0.7), (0.6, 0.4)):
        config = write_config(tmp_path / "m.yml", linear_config(a, m, weights=weights))
        api.run(config, m / "merged", restart=True)  # what is tested is what it leaves: in this process
    assert {name: sha for name, sha in _files(m).items() if "/merged/" not in name} == before
    assert (m / "merged" / "model.safetensors").is_file()


def test_a_recipe_never_writes_or_cleans_where_it_reads(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    out = tmp_path / "out"
    first = {"name": "first", **linear_config(a, b)}
    config = tmp_path / "r1.yml"
    config.write_text(yaml.safe_dump_all([first, linear_config(Path("first"), a, weights=(0.5, 0.5))]))
    api.run(config, out)  # the runs that succeed in this process; the refusal below through the CLI
    stage = tmp_path / "out.intermediates" / "first"
    before = _files(stage)
    # Stage "first" dropped, its output read by path: --restart deleted the 9 files of the folder it reads.
    second = {"name": "second", **linear_config(stage, b, weights=(0.5, 0.5))}
    config.write_text(yaml.safe_dump_all([second, linear_config(Path("second"), a, weights=(0.5, 0.5))]))
    api.run(config, out, restart=True)
    assert _files(stage) == before
    # A stage's output is an input's folder (here OUT, read by the first stage): refused before any stage runs.
    config.write_text(yaml.safe_dump_all([{"name": "third", **linear_config(out, b)},
                                          linear_config(Path("third"), a, weights=(0.5, 0.5))]))
    before = _files(out, stage)
    _refused(cli("run", config, out, "--restart"), "OUT is the folder of the input")
    with pytest.raises(ResumergeError) as planned:  # `resumerge plan`'s call
        api.estimate(config, out, probe_size=0)
    _refused_here(planned.value, "OUT is the folder of the input")
    assert _files(out, stage) == before


def test_the_sink_never_deletes_a_file_the_run_reads(tmp_path: Path, make: ModelFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The second line: with the planner's refusal taken away, --restart's deletion itself refuses the input's files.
    model = _merged(tmp_path, make, "model")
    before = _files(model)
    monkeypatch.setattr(drive, "refuse_out_over_inputs", lambda out, plan: None)
    config = write_config(tmp_path / "over.yml", linear_config(make("a", seed=1), model))
    with pytest.raises(UsageError) as refused:
        api.run(config, model, restart=True)
    assert "is a file this run reads as an input: resumerge never deletes or overwrites an input" in str(refused.value)
    assert _files(model) == before
