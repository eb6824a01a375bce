"""A SIGKILL in the middle of a matrix's approximated batches, then ``resume``: the output is byte-identical to an
uninterrupted run's, the killed run's finished batches are read back rather than computed again, ``status`` reports
the run as a transplant with its batches; and bad input is refused in one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from support import cli, digests

from resumerge import api
from transplant.pairs import make_pair

# 82 tokens approximated per matrix, in batches of 8: eleven batches each, twenty-two in all.
ARGS = ("-a", "randn", "--batch-size", "8", "-nvs", "0.1", "--random-seed", "5")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("pair"))


def _output(out: Path) -> dict[str, str]:
    return {n: d for n, d in digests(out).items() if not n.startswith("resumerge-")}


@pytest.mark.parametrize("nth", [3, 15])
def test_killed_mid_batches_resumes_to_the_same_bytes(pair: tuple[Path, Path], tmp_path: Path, nth: int) -> None:
    model, donor = pair
    reference = cli("tokensurgeon", model, donor, tmp_path / "ref", *ARGS, "--state-dir", tmp_path / "s0", "-q")
    assert reference.returncode == 0, reference.stderr
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("tokensurgeon", model, donor, out, *ARGS, "--state-dir", state, "-q",
                 env={"RESUMERGE_KILL_AT": f"after_surgery_batch:{nth}"})
    assert killed.returncode == -9, killed.stderr
    report = api.status(out, settings=api.Settings(state_dir=state))
    assert report.state == "interrupted"
    said = report.to_json()
    # the two matrices are computed side by side, each on two threads (the run's): the other three may each have
    # kept a batch more when the kill came
    kept = said["batches_done"]
    assert said["kind"] == "tokensurgeon" and nth <= kept <= nth + 3, said
    shown = cli("status", out, "--state-dir", state)
    assert f"batches approximated {kept}" in shown.stdout and "approximated by randn" in shown.stdout, shown.stdout
    # The elapsed time of a killed run counts to the last batch it kept (its record was last updated when it
    # started: status said less than it had said while the run was running). A batch dated an hour on says so.
    batches = list(state.rglob("*.rows"))
    later = max(p.stat().st_mtime for p in batches) + 3600
    os.utime(batches[0], (later, later))
    elapsed = api.status(out, api.Settings(state_dir=state)).elapsed_seconds
    assert elapsed is not None and elapsed >= 3600, elapsed
    os.utime(batches[0], (later - 3600, later - 3600))
    # the resume computes only the batches not kept: it reaches the point 22 - kept times
    resumed = cli("resume", out, "--state-dir", state, "-q",
                  env={"RESUMERGE_KILL_AT": f"after_surgery_batch:{22 - kept + 1}"})
    assert resumed.returncode == 0, resumed.stderr
    assert _output(out) == _output(tmp_path / "ref")
    assert api.status(out, settings=api.Settings(state_dir=state)).state == "done"
    assert not list(state.rglob("*.rows")), "the kept batches outlive the run"
    assert cli("verify", out, "--state-dir", state).returncode == 0


def test_the_result_loads_with_the_donors_tokenizer(pair: tuple[Path, Path], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, donor = pair
    api.tokensurgeon(str(model), str(donor), tmp_path / "out", surgery=api.Surgery(k=8),
                     settings=api.Settings(state_dir=tmp_path / "s"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert tokenizer.eos_token == "<|endoftext|>" and loaded.config.eos_token_id == tokenizer.eos_token_id
    card = (tmp_path / "out" / "README.md").read_text()
    assert "212 shared (copied)" in card and "82 approximated by omp (k=8)" in card


def _refused(args: list[str | Path], out: Path, said: str) -> None:
    ran = cli("tokensurgeon", *args, out, "--state-dir", out.parent / "state")
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], ran.stderr
    state = out.parent / "state"
    assert not out.exists() and not (state.exists() and any(p.is_file() for p in state.rglob("*"))), ran.stderr


def test_bad_input_is_one_line_exit_2_nothing_written(pair: tuple[Path, Path], tmp_path: Path) -> None:
    model, donor = pair
    bare = tmp_path / "bare"
    shutil.copytree(donor, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    _refused([model, bare], tmp_path / "a" / "out", "DONOR has no tokenizer")
    # a tokenizer_config.json alone (no vocabulary file): one line naming the files, not transformers' five lines
    # asking for sentencepiece, nor a transplant onto a tokenizer of its special tokens alone (issue 97)
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                            "bos_token": "<s>", "eos_token": "</s>"}))
    _refused([model, bare], tmp_path / "f" / "out",
             f"DONOR has no tokenizer files: none of tokenizer.json, tokenizer.model, vocab.json in {bare}")
    _refused([model, donor, "-k", "0"], tmp_path / "b" / "out", "-k must be at least 1")
    _refused([model, donor, "-k", "5000"], tmp_path / "c" / "out", "tokens MODEL and DONOR share")
    renamed = tmp_path / "renamed"
    shutil.copytree(donor, renamed)
    _rename(renamed, "model.embed_tokens.weight", "transformer.wte.weight")
    _refused([model, renamed], tmp_path / "d" / "out", "pass --allow-crimes")
    crimes = cli("tokensurgeon", model, renamed, tmp_path / "e" / "out", "-k", "8", "--allow-crimes", "-q",
                 "--state-dir", tmp_path / "e" / "state")
    assert crimes.returncode == 0, crimes.stderr


def _rename(folder: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        if old in tensors:
            tensors[new] = tensors.pop(old)
            save_file(tensors, str(path), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"][new] = doc["weight_map"].pop(old)
        index.write_text(json.dumps(doc))


def test_an_edit_of_models_tokenizer_before_resume_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """MODEL's tokenizer decides the match and the card's Tokens section as DONOR's does: an edit between a kill and
    ``resume`` that keeps every copied row (here a key tokenizers never reads) is refused in one line naming the
    file, before a byte is written."""
    model, donor = pair
    mine = tmp_path / "model"
    shutil.copytree(model, mine)
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("tokensurgeon", mine, donor, out, *ARGS, "--state-dir", state, "-q",
                 env={"RESUMERGE_KILL_AT": "after_surgery_batch:3"})
    assert killed.returncode == -9, killed.stderr
    config = json.loads((mine / "tokenizer_config.json").read_text())
    (mine / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    before = _output(out)
    resumed = cli("resume", out, "--state-dir", state)
    assert resumed.returncode == 4, resumed.stderr
    lines = [line for line in resumed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tokenizer_config.json changed" in lines[0], resumed.stderr
    assert _output(out) == before


def test_a_flag_the_card_shows_is_compared_when_the_run_goes_on(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """--allow-crimes changes no weight of a pair of one architecture, but the card's command line shows it: a run
    killed after its card was written and started again with the flag is refused, not finished with a card that
    lacks it."""
    model, donor = pair
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("tokensurgeon", model, donor, out, *ARGS, "--state-dir", state, "-q",
                 env={"RESUMERGE_KILL_AT": "during_tokenizer_write:1"})
    assert killed.returncode == -9, killed.stderr
    assert "--allow-crimes" not in (out / "README.md").read_text()
    again = cli("tokensurgeon", model, donor, out, *ARGS, "--allow-crimes", "--state-dir", state)
    assert again.returncode == 4, again.stderr
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model card" in lines[0], again.stderr


def test_a_transplant_killed_while_planning_is_told_with_its_own_command(pair: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """status and resume of a transplant killed while it matched the vocabularies: it died planning, and what
    continues it is the transplant's command, not ``resumerge run CONFIG OUT`` (issue 97)."""
    model, donor = pair
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("tokensurgeon", model, donor, out, "-k", "8", "--state-dir", state, "-q",
                 env={"RESUMERGE_KILL_AT": "after_surgery_match:1"})
    assert killed.returncode == -9, killed.stderr
    for command in ("status", "resume"):
        said = cli(command, out, "--state-dir", state)
        assert said.returncode == 4, said.stderr
        assert f"no tokensurgeon run recorded for {out}" in said.stderr and "killed while planning" in said.stderr
        assert f"run the same resumerge tokensurgeon MODEL DONOR {out} again" in said.stderr, said.stderr
        assert "resumerge run CONFIG" not in said.stderr, said.stderr
