"""A GGUF release (issue 95): ``--gguf-type`` given a comma list writes one file per type under OUT, named as
publishers name them (``NAME-Q4_K_M.gguf``), from one computation of each tensor (and one importance pass); each
file holds the bytes a run of its type alone writes, is journaled unit by unit on its own, and resumes on its own
after a real kill; ``status`` names each file, the card lists each with its size and bits per weight; what the flags
alone refuse is refused before any work."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ggufmodels import linear_llama_config, linear_llama_pair
from support import cli, cli_here, digests

from resumerge import api

TYPES = ("q8_0", "q6_k", "q4_k_m")  # a legacy type, a K type, a K-quant mix
FILES = ("model-Q8_0.gguf", "model-Q6_K.gguf", "model-Q4_K_M.gguf")
FLAGS = ("--out-type", "gguf", "--gguf-type", ",".join(TYPES), "--out-shard-size", "500k")


@pytest.fixture(scope="module")
def singles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """The tiny llama merge's config, the digest of each type's ``model.gguf`` from a run of that type alone (by
    the release's file name), and the release's OUT from an uninterrupted run."""
    root = tmp_path_factory.mktemp("release")
    config = linear_llama_config(root)
    found = {}
    for kind, file in zip(TYPES, FILES, strict=True):
        out = root / kind
        assert cli_here("run", config, out, "--state-dir", root / f"{kind}.state", "--out-type", "gguf",
                        "--gguf-type", kind).returncode == 0
        assert sorted(p.name for p in out.glob("*.gguf")) == ["model.gguf"]  # one type: today's name, unchanged
        found[file] = digests(out)["model.gguf"]
    release = root / "release"
    done = cli_here("run", config, release, "--state-dir", root / "release.state", *FLAGS)
    assert done.returncode == 0, done.stderr
    yield config, found, release


def _units(state: Path) -> dict[str, list[int]]:
    """The units journaled done, by file."""
    (ledger,) = state.rglob("ledger.db")
    with sqlite3.connect(ledger) as conn:
        rows = conn.execute("SELECT file, idx FROM units WHERE status = 'done' ORDER BY file, idx").fetchall()
    done: dict[str, list[int]] = {}
    for file, index in rows:
        done.setdefault(str(file), []).append(int(index))
    return done


def _gguf_digests(out: Path) -> dict[str, str]:
    return {name: sha for name, sha in digests(out).items() if name.endswith(".gguf")}


def test_each_file_of_a_release_holds_the_bytes_of_its_type_written_alone(
        singles: tuple[Path, dict[str, str], Path]) -> None:
    _, alone, release = singles
    assert _gguf_digests(release) == alone
    card = (release / "README.md").read_text()
    for file in FILES:  # each file with its size and bits per weight
        size = (release / file).stat().st_size
        row = next(line for line in card.splitlines() if line.startswith(f"| `{file}` |"))
        assert f"{size / 1e6:.3g} MB" in row or f"{size / 1e3:.3g} kB" in row, row
        assert float(row.split("|")[4]) > 0
    assert api.verify(release, settings=api.Settings(state_dir=release.parent / "release.state")).ok


def _killed_at(point: str, config: Path, folder: Path) -> tuple[Path, Path]:
    """``config``'s release run into ``folder``'s out and state, killed (SIGKILL) at ``point``: both folders."""
    out, state = folder / "out", folder / "state"
    killed = cli("run", config, out, "--state-dir", state, *FLAGS, env={"RESUMERGE_KILL_AT": point})
    assert killed.returncode == -9, killed.stderr
    return out, state


def test_a_release_killed_in_its_second_file_resumes_with_every_file_s_bytes(
        tmp_path: Path, singles: tuple[Path, dict[str, str], Path]) -> None:
    config, alone, _ = singles
    # the three headers (units 0), the Q8_0 file's first group, then the Q6_K file's first group written, not durable
    out, state = _killed_at("after_unit_write:5", config, tmp_path)
    assert _units(state) == {FILES[0]: [0, 1], FILES[1]: [0], FILES[2]: [0]}
    status = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    assert {name: (done, total) for name, done, total in status["unit_files"]} == {
        FILES[0]: (2, 4), FILES[1]: (1, 4), FILES[2]: (1, 3)}
    assert cli_here("resume", out, "--state-dir", state).returncode == 0
    assert _gguf_digests(out) == alone
    assert api.verify(out, settings=api.Settings(state_dir=state)).ok
    data = bytearray((out / FILES[1]).read_bytes())  # verify names the file of a release that differs
    data[-100] ^= 1
    (out / FILES[1]).write_bytes(bytes(data))
    report = json.loads(cli_here("verify", out, "--state-dir", state, "--json").stdout)
    assert [d["name"] for d in report["damaged"]] == [FILES[1]]


class _Written:
    """A reporter that keeps the tensors a run writes (what a resume merged again)."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def tensor_done(self, name: str, nbytes: int) -> None:
        self.written.append(name)

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


def test_a_release_killed_between_its_files_commits_the_others_without_merging_again(
        tmp_path: Path, singles: tuple[Path, dict[str, str], Path]) -> None:
    config, alone, _ = singles
    # every unit of every file durable, the Q8_0 file committed, the Q6_K file's commit begun
    out, state = _killed_at("after_temp_write:2", config, tmp_path)
    assert sorted(_gguf_digests(out)) == [FILES[0]]
    reporter = _Written()
    api.resume(out, settings=api.Settings(state_dir=state), progress=reporter)
    assert reporter.written == []  # every unit of the other files kept: committed, nothing merged again
    assert _gguf_digests(out) == alone


@pytest.mark.parametrize(("types", "extra", "says"), [
    ("q8_0,q2_k_s", (), "q2_k_s: llama.cpp's quantizer writes it only with an importance matrix"),
    ("q8_0,Q8_0", (), "a type given twice"),
    ("q8_0,q9_9", (), "q9_9 is not one of"),
    ("q8_0,q6_k", ("--gguf-split-max-size", "1MB"), "not split yet"),
])
def test_a_release_the_flags_refuse_is_refused_before_any_work(tmp_path: Path, types: str, extra: tuple[str, ...],
                                                                says: str) -> None:
    config = linear_llama_config(tmp_path)
    out = tmp_path / "out"
    done = cli_here("run", config, out, "--state-dir", tmp_path / "state", "--out-type", "gguf", "--gguf-type", types,
                    *extra)
    assert done.returncode == 2
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists() and not (tmp_path / "state").exists()


def test_a_release_computes_its_importance_matrix_once_for_every_file(tmp_path: Path) -> None:
    config, texts = linear_llama_pair(tmp_path, "the cat sat on the mat.\nhello there 123\nthe quick brown fox\n")
    flags = ("--out-type", "gguf", "--imatrix-texts", texts)
    assert cli_here("run", config, tmp_path / "q4", "--state-dir", tmp_path / "s4", *flags,
                    "--gguf-type", "q4_k_m").returncode == 0
    assert cli_here("run", config, tmp_path / "q8", "--state-dir", tmp_path / "s8", "--out-type", "gguf",
                    "--gguf-type", "q8_0").returncode == 0  # Q8_0 takes no importance weights
    release = tmp_path / "release"
    assert cli_here("run", config, release, "--state-dir", tmp_path / "sr", *flags,
                    "--gguf-type", "q8_0,q4_k_m").returncode == 0
    assert _gguf_digests(release) == {"model-Q8_0.gguf": digests(tmp_path / "q8")["model.gguf"],
                                      "model-Q4_K_M.gguf": digests(tmp_path / "q4")["model.gguf"]}
    status = json.loads(cli_here("status", release, "--state-dir", tmp_path / "sr", "--json").stdout)
    assert status["phase"]["of"] == 2  # one importance pass, then the merge writing both files


@pytest.mark.slow  # three runs of a generated Mixtral (as test_gguf_moe's own Mixtral merge, also slow)
def test_a_release_of_a_mixture_of_experts_writes_each_expert_s_slice_into_every_file(tmp_path: Path) -> None:
    """Mixtral's experts saved one by one, each merged alone and written as its slice of each file's stacks."""
    from support import write_config
    from test_gguf_moe import mixtral_pair

    paths = mixtral_pair(tmp_path)
    merge = write_config(tmp_path / "c.yml", {"merge_method": "slerp", "base_model": str(paths[0]), "name": "Tiny MoE",
                                              "dtype": "float32", "parameters": {"t": 0.4},
                                              "models": [{"model": str(p)} for p in paths]})
    alone = {}
    for kind in ("q8_0", "f16"):
        out = tmp_path / kind
        api.run(merge, out, settings=api.Settings(state_dir=tmp_path / f"s-{kind}",
                                                  output=api.Output(out_type="gguf", gguf_type=kind)))
        alone[f"Tiny-MoE-{kind.upper()}.gguf"] = digests(out)["model.gguf"]
    release = tmp_path / "release"
    api.run(merge, release, settings=api.Settings(state_dir=tmp_path / "s-release",
                                                  output=api.Output(out_type="gguf", gguf_type="q8_0,f16")))
    assert _gguf_digests(release) == alone  # named after the config's name:


def test_plan_counts_a_release_s_inputs_read_and_tensors_computed_once(tmp_path: Path) -> None:
    config = linear_llama_config(tmp_path)

    def planned(types: str) -> dict[str, object]:
        done = cli_here("plan", config, tmp_path / "out", "--out-type", "gguf", "--gguf-type", types,
                        "--probe-size", "0", "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    alone, release = planned("q8_0"), planned(",".join(TYPES))
    assert release["shards"] == list(FILES)
    assert release["time"]["read_bytes"] == alone["time"]["read_bytes"]  # type: ignore[index]
    assert release["time"]["compute"][0]["tensors"] == alone["time"]["compute"][0]["tensors"]  # type: ignore[index]
    # Each tensor counted once, the files named (it said "63 weight" for 21 tensors in 3 files).
    formats: dict[str, Any] = release["formats"]  # type: ignore[assignment]
    assert formats["output"]["roles"] == alone["formats"]["output"]["roles"]  # type: ignore[index]
    assert formats["output"]["files"] == list(FILES)
    said = cli_here("plan", config, tmp_path / "out", "--out-type", "gguf", "--gguf-type", ",".join(TYPES),
                    "--probe-size", "0")
    assert f"(21 weight, 0 companion, 0 other, in each of {', '.join(FILES)})" in said.stdout, said.stdout


def test_files_whose_codecs_are_equal_share_one_encoding_with_each_file_s_own_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A tensor's Q6_K in a Q6_K, a Q4_K_M and a Q5_K_M file (its ffn_down): encoded once, copied to the others;
    # each file's bytes those of its codec alone, by both of the codec's paths.
    import torch

    from resumerge.inputs.codecs.protocol import MAIN
    from resumerge.inputs.gguf.ggmltypes import Q4_K, Q6_K
    from resumerge.outputs.gguf import encoders
    from resumerge.outputs.gguf.outcodec import GgufOutCodec
    from resumerge.outputs.gguf.releasecodec import ReleaseCodec, file_part

    name, shape = "blk.0.ffn_down.weight", (8, 512)
    codecs = (GgufOutCodec(name, Q6_K), GgufOutCodec(name, Q4_K), GgufOutCodec(name, Q6_K))
    release = ReleaseCodec(("a", "b", "c"), codecs)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    alone = [c.encode(value, "F32") for c in codecs]
    calls: list[int] = []
    encode = encoders.encode

    def counted(rows: torch.Tensor, kind: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kind)
        return encode(rows, kind, *args, **kwargs)

    monkeypatch.setattr(encoders, "encode", counted)

    into = {p.part: torch.full(p.shape, 0xAA, dtype=torch.uint8) for p in release.out_parts(name, "F32", shape)}
    release.encode_into(value, "F32", into)
    assert sorted(calls) == sorted([Q6_K, Q4_K])  # the third file's Q6_K not encoded again
    encoded = release.encode(value, "F32")
    assert len(calls) == 4
    for file, mine in zip(release.files, alone, strict=True):
        for part, stored in mine.items():
            assert torch.equal(into[file_part(file, part)], stored)
            assert torch.equal(encoded[file_part(file, part)], stored)
    # each file's own tensor: the writer owns what it is handed
    assert encoded[file_part("c", MAIN)].data_ptr() != encoded[file_part("a", MAIN)].data_ptr()


def test_an_importance_matrix_is_no_difference_to_a_type_that_reads_none() -> None:
    # Q8_0 reads no matrix: the embeddings of a release's Q8_0 file (none given) and of its Q4_K_M file (the
    # release's matrix named) encode as one; Q4_K reads it: two encodings.
    from resumerge.inputs.gguf.ggmltypes import IQ3_S, IQ4_NL, IQ4_XS, Q4_K, Q8_0
    from resumerge.outputs.gguf.outcodec import GgufOutCodec
    from resumerge.outputs.gguf.releasecodec import same_as

    name, matrix = "token_embd.weight", "/state/imatrix/0123.gguf"
    assert same_as([GgufOutCodec(name, Q8_0), GgufOutCodec(name, Q8_0, imatrix=matrix)]) == [0, 0]
    assert same_as([GgufOutCodec(name, Q4_K), GgufOutCodec(name, Q4_K, imatrix=matrix)]) == [0, 1]
    # IQ4_NL standing in for IQ4_XS in one file and for IQ3_S in another (rows not of 256 values): one encoding
    assert same_as([GgufOutCodec(name, IQ4_NL, llama_type=IQ4_XS, imatrix=matrix),
                    GgufOutCodec(name, IQ4_NL, llama_type=IQ3_S, imatrix=matrix)]) == [0, 0]
    assert same_as([GgufOutCodec(name, Q4_K, imatrix=matrix), GgufOutCodec(name, Q8_0),
                    GgufOutCodec(name, Q4_K, imatrix=matrix), GgufOutCodec(name, Q8_0, transform="x")]) == [0, 1, 0, 3]
