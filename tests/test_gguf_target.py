"""``run --out-type gguf --gguf-target-size SIZE`` (or ``--gguf-target-bpw X``) with ``--imatrix-texts`` (issue 95):
each decoder layer matrix's type chosen by the costs the importance pass measures, the file within SIZE, the choice
recorded in the plan (the run's ledger and OUT's manifest) and named by ``status``; llama.cpp loads the file. A kill
(SIGKILL, a real process) in the pass's measurement or in the encoding after the choice leaves a recorded run that
``resume`` finishes with the bytes of a run never killed. A refusal the flags decide comes before any work."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggufmodels import LAYERS, linear_llama_pair
from llamacpp_oracle import imatrix_of_forward, needs_library
from support import cli as support_cli

TEXTS = "the cat sat on the mat.\nthree plus four is seven.\nabc def ghi 123 456\n"
# below the merge's Q4_K_M file with the same matrix (727,968 bytes), about 3 bits a weight: low enough for the 1-bit
# types to be chosen for some matrices, high enough for 4- and 5-bit ones beside them
TARGET = 450_000
MIX = ("--out-type", "gguf", "--gguf-type", "q4_k_m", "--out-shard-size", "100KB")
# A size-target run measures 14 candidate types on each of its 14 matrices (~10 CPU s): on two cores under a load of
# 30-40 one took 167 s of wall, past support.cli's 120 s, as test_run_phases' runs with --imatrix-texts did. 600 s
# still bounds a hung command.
cli = partial(support_cli, timeout=600)


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float16 linear merge of two tiny llama GGUFs (its config) and calibration texts the vocabulary spells."""
    return linear_llama_pair(tmp_path_factory.mktemp("target"), TEXTS)


def _args(merge: tuple[Path, Path], root: Path) -> tuple[str | Path, ...]:
    config, texts = merge
    return (config, root / "out", "--state-dir", root / "state", *MIX, "--imatrix-texts", texts,
            "--gguf-target-size", f"{TARGET // 1000}kB")


@pytest.fixture(scope="module")
def whole(merge: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The run never killed: OUT and its state dir."""
    root = tmp_path_factory.mktemp("whole")
    done = cli("run", *_args(merge, root))
    assert done.returncode == 0, done.stderr
    return root / "out", root / "state"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _status(out: Path, state: Path) -> dict[str, object]:
    done = cli("status", out, "--state-dir", state, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


def _types(model: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(model).tensors}


def test_the_file_is_within_the_target_in_the_types_its_plan_records(whole: tuple[Path, Path]) -> None:
    """The file is at most SIZE; every decoder matrix has the type the manifest records as chosen (14 of them,
    not all one type, the 1-bit i-quants among them), the head and the norms as the Q4_K_M mix writes them;
    ``status`` names the choice."""
    out, state = whole
    model = out / "model.gguf"
    assert model.stat().st_size <= TARGET
    options = json.loads((out / "resumerge-manifest.json").read_text())["options"]
    chosen = dict(pair.split("=") for pair in options["gguf_chosen_types"])
    assert len(chosen) == 7 * LAYERS
    types = _types(model)
    assert {name: types[name].lower() for name in chosen} == chosen
    assert len(set(chosen.values())) > 1 and {"iq1_s", "iq1_m"} & set(chosen.values()), chosen
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    notes = " ".join(map(str, _status(out, state)["plan_notes"]))  # type: ignore[call-overload]
    assert f"GGUF types chosen for --gguf-target-size {TARGET // 1000} kB" in notes, notes


def test_llama_cpp_loads_and_runs_the_file(whole: tuple[Path, Path]) -> None:
    needs_library()
    seen = imatrix_of_forward(whole[0] / "model.gguf", [list(range(1, 33))])
    assert seen and all(np.isfinite(sums).all() for sums, _ in seen.values())


def test_a_kill_in_the_measurement_is_a_recorded_run_that_resume_finishes(
        merge: tuple[Path, Path], whole: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed once the pass's first layer (its sums and costs) is durable, before any type is chosen: ``status``
    names the pass, layer 1 of 2; ``resume`` measures the rest, chooses and writes the bytes (and the manifest) of
    the run never killed."""
    killed = cli("run", *_args(merge, tmp_path), env={"RESUMERGE_KILL_AT": "after_imatrix_layer:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out, state = tmp_path / "out", tmp_path / "state"
    found = _status(out, state)
    assert found["state"] == "interrupted"
    assert found["phase"] == {"index": 0, "of": 2, "name": "the importance matrix pass over the merge",
                              "done": 1, "total": LAYERS, "unit": "layer"}
    resumed = cli("resume", out, "--state-dir", state)
    assert resumed.returncode == 0, resumed.stderr
    assert _sha(out / "model.gguf") == _sha(whole[0] / "model.gguf")
    assert (out / "resumerge-manifest.json").read_bytes() == (whole[0] / "resumerge-manifest.json").read_bytes()


def test_a_kill_in_the_encoding_after_the_choice_is_continued_by_the_same_run(
        merge: tuple[Path, Path], whole: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed once the chosen file's first unit is durable: the run recorded is the settled one (its choice in the
    ledger), ``status`` names the encoding, and the same ``run`` command again (planned with the mix's types, not
    yet the choice) continues it to the same bytes, as ``resume`` would. The state dir holds the never-killed run's
    importance matrix and costs, which the pass finds computed (a test of a kill after the pass: its measurement, ~12
    CPU s, is the test above's); the choice is made from them again, as it is after a fresh pass."""
    shutil.copytree(whole[1] / "imatrix", tmp_path / "state" / "imatrix")
    killed = cli("run", *_args(merge, tmp_path), env={"RESUMERGE_KILL_AT": "after_unit_commit:1"})
    assert "importance matrix found computed on the merge" in killed.stderr + killed.stdout, killed.stderr
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    out, state = tmp_path / "out", tmp_path / "state"
    found = _status(out, state)
    assert found["state"] == "interrupted" and found["units_done"] == 1
    assert found["phase"] == {"index": 1, "of": 2, "name": "the merge and its GGUF encoding"}
    again = cli("run", *_args(merge, tmp_path))
    assert again.returncode == 0, again.stderr
    assert _sha(out / "model.gguf") == _sha(whole[0] / "model.gguf")


def test_a_bits_per_weight_target(merge: tuple[Path, Path], whole: tuple[Path, Path], tmp_path: Path) -> None:
    """``--gguf-target-bpw 4.2``: the tensors' bytes are at most 4.2 bits per weight over every tensor's values.
    The state dir holds the size target's importance matrix and costs: the pass finds them computed (its key is a
    pass that measures costs, as a size target's is: a bits-per-weight run whose pass measured none would compute
    its own), and the choice for 4.2 bits is made from them (the measurement, ~18 CPU s, is the tests' above)."""
    config, texts = merge
    out = tmp_path / "out"
    shutil.copytree(whole[1] / "imatrix", tmp_path / "state" / "imatrix")
    done = cli("run", config, out, "--state-dir", tmp_path / "state", *MIX, "--imatrix-texts", texts,
               "--gguf-target-bpw", "4.2")
    assert done.returncode == 0, done.stderr
    assert "importance matrix found computed on the merge" in done.stderr + done.stdout, done.stderr
    tensors = gguf.GGUFReader(out / "model.gguf").tensors
    bits = 8 * sum(int(t.n_bytes) for t in tensors) / sum(math.prod(int(d) for d in t.shape) for t in tensors)
    assert 3.9 < bits <= 4.2


@pytest.mark.parametrize(("flags", "said"), [
    (("--gguf-target-size", "600kB", "--gguf-target-bpw", "4"), "give one"),
    (("--gguf-target-size", "100kB"), "below the smallest this merge's GGUF can be"),
    (("--gguf-target-bpw", "0"), "a number of bits per weight above 0"),
    (("--gguf-target-size", "600kB", "--gguf-split-max-size", "100kB"), "not with --gguf-split-max-size"),
    (("--gguf-target-size", "600kB", "--gguf-tensor-type", "ffn=q8_0"), "not with --gguf-tensor-type"),
    (("--gguf-type", "q8_0,q4_k_m", "--gguf-target-size", "600kB"), "not with a --gguf-type list"),
])
def test_a_refusal_the_flags_decide_comes_before_any_work(merge: tuple[Path, Path], tmp_path: Path,
                                                          flags: tuple[str, ...], said: str) -> None:
    """Both targets, one below the smallest file the merge can be, a bad number, a split or per-tensor types: one
    clear line, exit 2, before the pass (no matrix) or OUT."""
    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "state"
    refused = cli("run", config, out, "--state-dir", state, *MIX, "--imatrix-texts", texts, *flags)
    assert refused.returncode == 2, refused.stderr
    assert said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert not out.exists() and not (state / "imatrix").exists()


def test_a_target_without_texts_is_refused(merge: tuple[Path, Path], tmp_path: Path) -> None:
    config, _ = merge
    refused = cli("run", config, tmp_path / "out", "--state-dir", tmp_path / "state", *MIX, "--gguf-target-size",
                  "600kB")
    assert refused.returncode == 2, refused.stderr
    assert "give --imatrix-texts FILE" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()


def test_a_target_without_a_mix_that_reads_the_matrix_says_what_the_target_needs(merge: tuple[Path, Path],
                                                                                  tmp_path: Path) -> None:
    """Without --gguf-type (f16, the default, which reads no matrix) the target says that the tensors it does not
    choose are written as --gguf-type's mix and names one, not that an --gguf-type the user never gave takes no
    matrix: one line, exit 2, nothing written."""
    config, texts = merge
    refused = cli("run", config, tmp_path / "out", "--state-dir", tmp_path / "state", "--out-type", "gguf",
                  "--imatrix-texts", texts, "--gguf-target-bpw", "4.5")
    assert refused.returncode == 2, refused.stderr
    assert "--gguf-target-bpw chooses the types of the decoder layers' matrices" in refused.stderr, refused.stderr
    assert "--gguf-type q4_k_m" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "state" / "imatrix").exists()
