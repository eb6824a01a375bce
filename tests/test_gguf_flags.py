"""The GGUF output's flags as a new user gives them (issue 97, item 8): ``--gguf-type`` without ``--out-type gguf``
refused as ``--imatrix-texts`` is (it was ignored: safetensors written), llama.cpp's upper-case spelling of a type
(``Q4_K_M``) taken as the lower-case one by every flag, a type that is none refused in one line, and a model's GGUF
given as ``--imatrix`` said to be a model, not an importance matrix (it was "ggml type 1 (F16) … cannot decode")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import cli_here

from resumerge import api
from resumerge.errors import UsageError


def _config(tmp_path: Path) -> Path:
    from ggufmodels import linear_llama_config

    return linear_llama_config(tmp_path)


def _refused_in_one_line(tmp_path: Path, *words: str | Path) -> str:
    done = cli_here(*words)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    return done.stderr


def test_a_gguf_type_without_a_gguf_output_is_refused_as_imatrix_texts_is(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    said = _refused_in_one_line(tmp_path, "run", cfg, tmp_path / "out", "--gguf-type", "q4_k_m")
    assert "--gguf-type chooses a GGUF output's types: give it with --out-type gguf" in said, said
    # the API's guard, whoever calls (its words are the API's names)
    with pytest.raises(UsageError, match="gguf_type chooses a GGUF output's types: give it with out_type gguf"):
        api.plan_merge(cfg, settings=api.Settings(output=api.Output(gguf_type="q8_0")))
    # the default, and the type with the output it chooses for, stay accepted
    assert cli_here("plan", cfg, "--probe-size", "0", "--json").returncode == 0


def test_llama_cpps_upper_case_type_names_are_the_lower_case_ones(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    prints = []
    for kind, head in (("q8_0", "q8_0"), ("Q8_0", "Q8_0")):
        done = cli_here("plan", cfg, "--out-type", "gguf", "--gguf-type", kind, "--gguf-output-type", head,
                        "--gguf-tensor-type", "ATTN_Q=F16", "--probe-size", "0", "--json")
        assert done.returncode == 0, done.stderr
        prints.append(json.loads(done.stdout)["fingerprint"])
    assert prints[0] == prints[1]  # the same plan
    said = _refused_in_one_line(tmp_path, "run", cfg, tmp_path / "out", "--out-type", "gguf", "--gguf-type",
                                "Q9_Z")
    assert "--gguf-type Q9_Z: one of f16, bf16" in said and "q4_k_m" in said, said


def test_a_models_gguf_given_as_imatrix_is_said_to_be_a_model(tmp_path: Path) -> None:
    from ggufmodels import Q, hf_tensors, to_gguf, write_gguf

    model = tmp_path / "model.gguf"
    write_gguf(model, "llama", to_gguf("llama", hf_tensors("llama")), Q.F16)
    cfg = _config(tmp_path)
    said = _refused_in_one_line(tmp_path, "run", cfg, tmp_path / "out", "--out-type", "gguf", "--gguf-type",
                                "q4_k_m", "--imatrix", model)
    assert f"--imatrix {model}: it is a model GGUF (llama), not an importance matrix" in said, said
    assert "ggml type" not in said and "llama-imatrix -m MODEL.gguf" in said, said
