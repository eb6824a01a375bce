"""llama-quantize's remaining switches a publisher uses (issue 95): ``--gguf-tensor-type-file``,
``--gguf-override-kv KEY=TYPE:VALUE`` and ``--pure`` give the tensors and key-values ``llama_model_quantize`` gives
with the same pairs, overrides and ``pure``; an ``--imatrix`` output carries the ``quantize.imatrix.*`` keys
llama-quantize adds (the matrix's base name, never a machine path); bad input is one line, exit 2, before any
work; the tensor-type file's content (not its path) is the plan's. llama.cpp's own library is the oracle
(tests/llamacpp_oracle.py); the oracle tests skip where it does not load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import encoderparity as parity
import gguf
import numpy as np
import pytest
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from llamacpp_oracle import needs_library, quantize_model
from support import cli, cli_here, write_config

from resumerge import api
from resumerge.api.options import Output, plan_options
from resumerge.merge.plan.gguftypes import MIXES, OVERRIDE_TYPES, ModelFacts, TypeChoices, tensor_type
from resumerge.outputs.gguf.imatrix import matrix_facts, read_imatrix


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float16 llama merge's config (values exact in F16) and the F16 GGUF resumerge writes of it."""
    root = tmp_path_factory.mktemp("switches")
    a, b = root / "a.gguf", root / "b.gguf"
    write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
    write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.F32)
    config = write_config(root / "c.yml", {"merge_method": "linear", "dtype": "float16", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    api.run(config, root / "f16", settings=api.Settings(state_dir=root / "s", output=api.Output(out_type="gguf",
                                                                                                gguf_type="f16")))
    return config, root / "f16" / "model.gguf"


def _file(path: Path) -> tuple[dict[str, tuple[int, bytes]], dict[str, tuple[list[int], Any]]]:
    """A GGUF's tensors (type, bytes) and key-values (types, value) by name, in the file's order."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in reader.tensors}
    kv = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = [f.parts[i].tobytes() for i in f.data] if f.data else None
        kv[key] = ([int(t) for t in f.types], value)
    return tensors, kv


def test_pure_the_file_s_pairs_overrides_and_imatrix_keys_are_llama_quantize_s(
        tmp_path: Path, merge: tuple[Path, Path]) -> None:
    """--pure, --gguf-tensor-type-file, --gguf-override-kv and --imatrix through the CLI give the tensors (types and
    bytes) and the key-values (types and values) llama_model_quantize gives the same F16 file with pure, the same
    pairs, the same overrides and after them the quantize.imatrix.* keys llama-quantize adds; those keys come last,
    in llama-quantize's order; under --pure the head is the mix's default type (not Q6_K), the file's pairs apply."""
    needs_library()
    config, f16 = merge
    raw = parity.imatrix_entries(f16, 3)
    parity.write_imatrix_gguf(tmp_path / "my.imatrix.gguf", raw)
    (tmp_path / "types.txt").write_text("attn_q=Q8_0  blk\\.1\\.ffn_up=q5_k\n\nffn_down=q6_k\n")
    out = tmp_path / "out"
    kvs = ("general.name=str:merged by me", "llama.context_length=int:4096", "x.ratio=float:0.25", "x.flag=bool:true")
    done = cli("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type", "q4_k_m",
               "--pure", "--gguf-tensor-type-file", tmp_path / "types.txt", "--imatrix", tmp_path / "my.imatrix.gguf",
               *(arg for kv in kvs for arg in ("--gguf-override-kv", kv)))
    assert done.returncode == 0, done.stderr
    user = (("general.name", "str", "merged by me"), ("llama.context_length", "int", 4096),
            ("x.ratio", "float", 0.25), ("x.flag", "bool", True))
    imatrix = (("quantize.imatrix.file", "str", "my.imatrix.gguf"),
               ("quantize.imatrix.dataset", "str", "calibration.txt"),
               ("quantize.imatrix.entries_count", "int", len(raw)), ("quantize.imatrix.chunks_count", "int", 4))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type, pure=True,
                   imatrix=parity.as_llama_quantize_takes_it(raw), kv_overrides=user + imatrix,
                   tensor_types=(("attn_q", OVERRIDE_TYPES["q8_0"]), ("blk\\.1\\.ffn_up", OVERRIDE_TYPES["q5_k"]),
                                 ("ffn_down", OVERRIDE_TYPES["q6_k"])))
    (ours, our_kv), (theirs, their_kv) = _file(out / "model.gguf"), _file(tmp_path / "llama.gguf")
    assert {n: t for n, (t, _) in ours.items()} == {n: t for n, (t, _) in theirs.items()}
    assert [n for n in ours if ours[n][1] != theirs[n][1]] == []
    assert our_kv == their_kv
    assert list(our_kv)[-len(user) - len(imatrix):] == [key for key, _, _ in user + imatrix]
    types = {n: t for n, (t, _) in ours.items()}
    assert (types["output.weight"], types["blk.0.attn_v.weight"], types["blk.0.attn_q.weight"]) == (12, 12, 8)


def test_pure_keeps_the_overrides_and_the_row_fallback() -> None:
    """llama.cpp's --pure (checked against llama_model_quantize on a 288-wide ffn_down: Q5_0): the mix's bumps and
    the head's Q6_K are gone, --gguf-output-type and a pattern still apply, a row of no whole 256-blocks falls back."""
    pure = TypeChoices(tensor_types=(("attn_q", OVERRIDE_TYPES["q8_0"]),), pure=True)
    facts = ModelFacts(layers=8)
    assert tensor_type("output.weight", (40, 256), "q4_k_m", facts, pure).written == OVERRIDE_TYPES["q4_k"]
    assert tensor_type("output.weight", (40, 256), "q4_k_m", facts).written == OVERRIDE_TYPES["q6_k"]
    assert tensor_type("blk.0.attn_v.weight", (128, 256), "q4_k_m", facts, pure).written == OVERRIDE_TYPES["q4_k"]
    assert tensor_type("blk.0.attn_q.weight", (256, 256), "q4_k_m", facts, pure).written == OVERRIDE_TYPES["q8_0"]
    assert tensor_type("blk.0.ffn_down.weight", (256, 288), "q4_k_m", facts, pure).written == OVERRIDE_TYPES["q5_0"]
    head = TypeChoices(output=OVERRIDE_TYPES["q8_0"], pure=True)
    assert tensor_type("output.weight", (40, 256), "q4_k_m", facts, head).written == OVERRIDE_TYPES["q8_0"]


def test_the_tensor_type_file_s_content_is_the_plan_s_not_its_path(tmp_path: Path) -> None:
    """The file's pairs follow --gguf-tensor-type's in the plan's options (lower-cased as theirs); another path
    with the same content plans the same; other content plans otherwise."""
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("attn_Q=Q8_0\nffn_down=q6_k output=q5_k\n")
    second.write_text(first.read_text())

    def planned(path: Path) -> Any:
        return plan_options(Output(out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=("attn_k=q5_0",),
                                   gguf_tensor_type_file=path), out_shard_size=None)

    options = planned(first)
    assert options.gguf_tensor_types == ("attn_k=q5_0", "attn_q=q8_0", "ffn_down=q6_k", "output=q5_k")
    assert str(tmp_path) not in repr(options)
    assert planned(second) == options
    second.write_text("attn_q=q4_k\n")
    assert planned(second) != options


@pytest.mark.parametrize(("flags", "words"), [
    (("--gguf-tensor-type-file", "{types}"), "types.txt:2"),
    (("--gguf-tensor-type-file", "{missing}"), "--gguf-tensor-type-file"),
    (("--gguf-override-kv", "general.name"), "KEY=TYPE:VALUE"),
    (("--gguf-override-kv", "a.b=long:3"), "int, float, bool, str"),
    (("--gguf-override-kv", "a.b=int:-3"), "uint32"),
    (("--gguf-override-kv", "a.b=int:4294967296"), "uint32"),
    (("--gguf-override-kv", "a.b=float:x"), "float32"),
    (("--gguf-override-kv", "a.b=bool:yes"), "true or false"),
    (("--gguf-override-kv", "a.b=str:" + "x" * 128), "127 bytes"),
    (("--gguf-override-kv", "general.alignment=int:64"), "alignment"),
])
def test_a_bad_switch_is_refused_in_one_line_before_any_work(tmp_path: Path, flags: tuple[str, ...],
                                                             words: str) -> None:
    """A bad line of the tensor-type file (named file:line), a file that is not there, each malformed override:
    exit 2, one line naming it, nothing written; and each switch without --out-type gguf."""
    (tmp_path / "types.txt").write_text("attn_q=q8_0\nffn_down=q9_k\n")
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(tmp_path / "nowhere-a"), "parameters": {"weight": 0.5}},
        {"model": str(tmp_path / "nowhere-b"), "parameters": {"weight": 0.5}}]})
    given = [f.format(types=tmp_path / "types.txt", missing=tmp_path / "none.txt") for f in flags]
    out = tmp_path / "out"
    done = cli_here("run", config, out, "--state-dir", tmp_path / "s", "--out-type", "gguf", "--gguf-type",
                    "q4_k_m", *given)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr
    assert not out.exists()
    for switch in (["--pure"], ["--gguf-override-kv", "a.b=int:1"], ["--gguf-tensor-type-file", str(tmp_path)]):
        done = cli_here("run", config, out, "--state-dir", tmp_path / "s", *switch)
        assert done.returncode == 2 and "--out-type gguf" in done.stderr, (switch, done.stderr)


def test_the_imatrix_keys_read_both_formats(tmp_path: Path) -> None:
    """The dataset and chunk count llama-quantize's load_imatrix reads: GGUF's first imatrix.datasets and
    imatrix.chunk_count; .dat's name and count after its entries."""
    raw = {"blk.0.attn_q.weight": (np.ones((1, 32), np.float32), np.array([3], np.float32)),
           "blk.0.ffn_up.weight": (np.ones((1, 64), np.float32), np.array([0], np.float32))}
    parity.write_imatrix_gguf(tmp_path / "m.gguf", raw)
    parity.write_imatrix_dat(tmp_path / "m.dat", raw)
    for path in (tmp_path / "m.gguf", tmp_path / "m.dat"):
        assert matrix_facts(path, read_imatrix(path)) == ("calibration.txt", 4), path


def test_a_transplant_s_suggested_command_keeps_the_switches() -> None:
    """The output flags a transplant's message gives for the follow-up run name the overrides and --pure (the
    tensor-type file's pairs as --gguf-tensor-type's, since the plan holds them)."""
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.runs.transplant.planner import output_flags

    flags = output_flags(PlanOptions(out_type="gguf", gguf_type="q4_k_m", gguf_tensor_types=("attn_q=q8_0",),
                                     gguf_override_kv=("general.name=str:x",), gguf_pure=True))
    assert " ".join(flags).endswith("--gguf-tensor-type attn_q=q8_0 --gguf-override-kv general.name=str:x --pure")
