"""Importance matrices resumerge makes (issue 84): ``run --out-type gguf --imatrix-texts FILE`` computes llama.cpp's
importance matrix on the merge itself, never written, and encodes with it; ``measure --imatrix OUT.gguf`` writes one
from the Grams. Checked against independent oracles: transformers running the written merge with hooks on its linears
(what llama-imatrix sums: each input column's squares), ``measure``'s Grams of the written merge, and llama.cpp's own
quantizer (``llama_model_quantize`` given the same matrix: the same bytes). A kill in the pass (a real subprocess)
or in the encoding resumes to the same bytes; a changed texts file is a changed plan; the flag's misuses are one
line, exit 2."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggufmodels import HIDDEN, LAYERS, Q, hf_tensors, linear_llama_pair, to_gguf, write_gguf
from llamacpp_oracle import needs_library, quantize_model
from support import cli as support_cli
from support import write_config

from resumerge import api
from resumerge.inputs.gguf.names import gguf_name
from resumerge.merge.plan.gguftypes import MIXES
from resumerge.outputs.gguf.imatrix import read_imatrix

TEXTS = "the cat sat on the mat.\nthree plus four is seven.\nabc def ghi 123 456\n"
K_MIX = ("--out-type", "gguf", "--gguf-type", "q4_k_m")
# Its commands with --imatrix-texts start the pass's interpreters (torch imported again): a plan of them passed
# support.cli's 120 s on two cores under a load of 30-40, as test_run_phases' did. 600 s still bounds a hung command.
cli = partial(support_cli, timeout=600)


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A float16 linear merge of two tiny llama GGUFs (its config) and calibration texts the vocabulary spells."""
    return linear_llama_pair(tmp_path_factory.mktemp("imatrix"), TEXTS)


@pytest.fixture(scope="module")
def computed(merge: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The merge run to Q4_K_M with its importance matrix computed on it: OUT and the matrix the run wrote."""
    config, texts = merge
    root = tmp_path_factory.mktemp("computed")
    api.run(config, root / "out", settings=api.Settings(state_dir=root / "s", output=api.Output(out_type="gguf",
                                                                                                gguf_type="q4_k_m",
                                                                                                imatrix_texts=texts)))
    (matrix,) = (root / "s" / "imatrix").glob("*.gguf")
    return root / "out", matrix


@pytest.fixture(scope="module")
def written(merge: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same merge written as safetensors (no test writes there)."""
    config, _ = merge
    root = tmp_path_factory.mktemp("written")
    api.run(config, root / "out", settings=api.Settings(state_dir=root / "s"))
    return root / "out"


@pytest.fixture(scope="module")
def f16(merge: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same merge written as an F16 GGUF, what llama_model_quantize is given (no test writes there)."""
    config, _ = merge
    root = tmp_path_factory.mktemp("f16")
    api.run(config, root / "out", settings=api.Settings(state_dir=root / "s", output=api.Output(out_type="gguf",
                                                                                               gguf_type="f16")))
    return root / "out" / "model.gguf"


def _gguf_bytes(path: Path) -> dict[str, tuple[int, bytes]]:
    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def test_the_matrix_is_what_transformers_running_the_written_merge_sums(
        merge: tuple[Path, Path], computed: tuple[Path, Path], written: Path) -> None:
    """Per weight of the decoder blocks, the sums of its input's squares over every token of the texts, over the
    count (llama-imatrix's entry as llama-quantize reads it): transformers' forward of the merge written as
    safetensors, hooked before each linear, gives the same values; the matrix names each weight as llama.cpp does
    and counts every token; the card says it was computed on the merge."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, texts = merge
    out, matrix = computed
    model = transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(written)
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def observe(module: object, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
        return observe

    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook(f"model.layers.{name}.weight"))
    tokens = 0
    for line in TEXTS.splitlines():
        ids = tokenizer(line, return_tensors="pt").input_ids
        tokens += ids.shape[1]
        with torch.no_grad():
            model(ids)
    ours = read_imatrix(matrix)
    assert sorted(ours) == sorted(gguf_name("llama", n) for n in sums)
    for name, total in sums.items():
        expected = (total / tokens).numpy()
        assert np.allclose(ours[gguf_name("llama", name)], expected, rtol=1e-5, atol=1e-7), name
    reader = gguf.GGUFReader(matrix)
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.chunk_count"].contents() == 3
    counts = {float(np.asarray(t.data).max()) for t in reader.tensors if t.name.endswith(".counts")}
    assert counts == {float(tokens)}
    card = (out / "README.md").read_text()
    assert f"computed on the merge from 3 texts, {tokens} tokens of `{texts.name}`" in card


def test_the_merge_is_encoded_as_llama_quantize_encodes_it_with_that_matrix(
        merge: tuple[Path, Path], computed: tuple[Path, Path], f16: Path, tmp_path: Path) -> None:
    """llama_model_quantize of the merge's F16 GGUF, given the computed matrix, writes the very bytes the run wrote,
    and the key-values, the ``quantize.imatrix.*`` keys llama-quantize adds for that matrix among them (as for
    ``--imatrix``: its base name, the texts' base name, its entries and its chunks, one a text); without a matrix,
    other bytes (the matrix was used)."""
    from test_gguf_switches import _file

    needs_library()
    _, texts = merge
    out, matrix = computed
    keys = (("quantize.imatrix.file", "str", matrix.name), ("quantize.imatrix.dataset", "str", texts.name),
            ("quantize.imatrix.entries_count", "int", len(read_imatrix(matrix))),
            ("quantize.imatrix.chunks_count", "int", len(TEXTS.splitlines())))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q4_k_m"].file_type, imatrix=read_imatrix(matrix),
                   kv_overrides=keys)
    ours, theirs = _gguf_bytes(out / "model.gguf"), _gguf_bytes(tmp_path / "llama.gguf")
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []
    our_kv, their_kv = _file(out / "model.gguf")[1], _file(tmp_path / "llama.gguf")[1]
    assert our_kv == their_kv
    assert list(our_kv)[-len(keys):] == [key for key, _, _ in keys]
    quantize_model(f16, tmp_path / "plain.gguf", MIXES["q4_k_m"].file_type)
    plain = _gguf_bytes(tmp_path / "plain.gguf")
    assert any(ours[n] != plain[n] for n in plain)


def measured_matrix(written: Path, texts: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``measure --imatrix tmp_path/measured.gguf`` of the written merge over ``texts``: the finished command (it
    worked) and the matrix."""
    one = write_config(tmp_path / "one.yml", {"merge_method": "passthrough", "models": [{"model": str(written)}]})
    measured = tmp_path / "measured.gguf"
    done = cli("measure", one, tmp_path / "grams", "--texts", texts, "--state-dir", tmp_path / "s",
               "--imatrix", measured)
    assert done.returncode == 0, done.stderr
    return done, measured


def test_measure_writes_the_matrix_llama_quantize_takes(merge: tuple[Path, Path], computed: tuple[Path, Path],
                                                        written: Path, f16: Path, tmp_path: Path) -> None:
    """``measure --imatrix`` of the written merge: the Grams' diagonals times the tokens, equal (to float rounding)
    to the matrix the run computed on the merge never written; given back to ``run --imatrix``, the bytes equal
    llama_model_quantize's with the same matrix."""
    config, texts = merge
    _, matrix = computed
    done, measured = measured_matrix(written, texts, tmp_path)
    assert f"14 weight(s) in {measured}" in done.stdout
    ours, theirs = read_imatrix(measured), read_imatrix(matrix)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert np.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name
    needs_library()
    api.run(config, tmp_path / "q", api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q3_k_m", imatrix=measured)))
    quantize_model(f16, tmp_path / "llama.gguf", MIXES["q3_k_m"].file_type, imatrix=ours)
    got, want = _gguf_bytes(tmp_path / "q" / "model.gguf"), _gguf_bytes(tmp_path / "llama.gguf")
    assert [n for n in want if got[n] != want[n]] == []


def test_the_pass_asks_the_merge_for_the_embedding_rows_its_texts_use(
        merge: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass asks the merge for the input embeddings' rows its texts' tokens use, once (a merge of plain inputs
    merges them alone: :func:`~resumerge.merge.engine.unwritten.compute.merged_rows`; these GGUF inputs' codecs
    are not plain, so the table is merged whole after all, as before)."""
    from resumerge.merge.engine.unwritten.merged import MergedFiles

    config, texts = merge
    whole: list[str] = []
    rows: list[int] = []
    real_part, real_rows = MergedFiles._part, MergedFiles.read_rows

    def part(self: MergedFiles, name: str, part: str) -> object:
        whole.append(name)
        return real_part(self, name, part)

    def read_rows(self: MergedFiles, *args: object) -> object:
        found = real_rows(self, *args)  # type: ignore[arg-type]
        rows.append(-1 if found is None else int(found.shape[0]))
        return found

    monkeypatch.setattr(MergedFiles, "_part", part)
    monkeypatch.setattr(MergedFiles, "read_rows", read_rows)
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    assert rows == [-1]  # asked, and answered "not alone"
    assert whole.count("model.embed_tokens.weight") == 1


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_kill_in_the_pass_or_in_the_encoding_resumes_to_the_same_bytes(
        merge: tuple[Path, Path], computed: tuple[Path, Path], tmp_path: Path) -> None:
    """The run killed (SIGKILL, a real process) after the pass's first layer is durable, run again, resumes the
    pass at the second layer; killed while the GGUF is written, ``resume`` finishes it; both files are the bytes
    of a run never killed. A resume whose texts file changed since is another plan: refused (exit 4)."""
    config, texts = merge
    whole, _ = computed
    out, state = tmp_path / "out", tmp_path / "s"
    args = ("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts)
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_imatrix_layer:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (folder,) = (p for p in (state / "imatrix").iterdir() if p.is_dir())
    assert [p.name for p in folder.glob("*/layer-*.safetensors")] == ["layer-00000.safetensors"]
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert _sha(out / "model.gguf") == _sha(whole / "model.gguf")

    out2, state2 = tmp_path / "out2", tmp_path / "s2"
    killed = cli("run", config, out2, "--state-dir", state2, *K_MIX, "--imatrix-texts", texts,
                 "--out-shard-size", "100KB", env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = cli("resume", out2, "--state-dir", state2)
    assert resumed.returncode == 0, resumed.stderr
    assert _sha(out2 / "model.gguf") == _sha(whole / "model.gguf")

    out3, state3 = tmp_path / "out3", tmp_path / "s3"
    changed = tmp_path / "changed.txt"
    changed.write_text(TEXTS)
    killed = cli("run", config, out3, "--state-dir", state3, *K_MIX, "--imatrix-texts", changed,
                 "--out-shard-size", "100KB", env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    changed.write_text(TEXTS + "one more text.\n")
    refused = cli("resume", out3, "--state-dir", state3)
    assert refused.returncode == 4, refused.stderr
    assert "Traceback" not in refused.stderr


def test_plan_says_the_pass_will_run_and_misuses_are_one_line(merge: tuple[Path, Path], tmp_path: Path) -> None:
    config, texts = merge
    planned = cli("plan", config, *K_MIX, "--imatrix-texts", texts)
    assert planned.returncode == 0, planned.stderr
    assert f"the importance matrix is computed on the merge from the texts of {texts.name}" in planned.stdout
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for flags, said in (((*K_MIX, "--imatrix-texts", texts, "--imatrix", tmp_path / "m.gguf"), "give one"),
                        (("--out-type", "gguf", "--gguf-type", "q8_0", "--imatrix-texts", texts),
                         "takes no importance matrix"),
                        ((*K_MIX, "--imatrix-texts", tmp_path / "none.txt"), "no such file"),
                        (("--imatrix-texts", texts), "--out-type gguf")):
        done = cli("run", config, tmp_path / "out", "--state-dir", tmp_path / "s", *flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "out").exists()
    moe = tmp_path / "moe.yml"  # a kind of run whose pass the importance matrix's would not precede
    moe.write_text(f"base_model: {config.parent / 'a.gguf'}\nexperts:\n  - source_model: {config.parent / 'b.gguf'}\n"
                   "    positive_prompts: [the cat]\n")
    done = cli("run", moe, tmp_path / "out", "--state-dir", tmp_path / "s", *K_MIX, "--imatrix-texts", texts)
    assert done.returncode == 2 and "of a single merge" in done.stderr, done.stderr
    experts = []  # a merge of mixtures of experts: its pass measures each expert (tests/test_imatrix_moe.py)
    for seed in (1, 2):  # named as the other tests' qwen3moe parents: their tokenizer is rebuilt once a session
        experts.append(tmp_path / f"{'ab'[seed - 1]}.gguf")
        write_gguf(experts[-1], "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=seed)), Q.F32)
    moe = write_config(tmp_path / "experts.yml", {"merge_method": "linear", "models": [
        {"model": str(e), "parameters": {"weight": 0.5}} for e in experts]})
    planned = cli("plan", moe, *K_MIX, "--imatrix-texts", texts)
    assert planned.returncode == 0, planned.stderr
    assert "the importance matrix pass over the merge" in planned.stdout


def test_plan_counts_the_pass_its_time_memory_and_state_dir_bytes(merge: tuple[Path, Path], tmp_path: Path) -> None:
    """``plan`` with ``--imatrix-texts`` counts the pass before the merge: the inputs it reads (the embeddings' and
    every layer's, not the head's), the tokens it runs, its journal and matrix in the state dir's disk need, what it
    holds in the peak, and its seconds in the total; the same plan without the flag counts none of it."""
    import json

    config, texts = merge
    state = tmp_path / "s"
    without = json.loads(cli("plan", config, tmp_path / "out", "--state-dir", state, *K_MIX, "--json").stdout)
    done = cli("plan", config, tmp_path / "out", "--state-dir", state, *K_MIX, "--imatrix-texts", texts, "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert without["first_pass"] is None and without["memory"]["first_pass_bytes"] == 0
    first = found["first_pass"]
    hidden, layers = HIDDEN, LAYERS  # ggufmodels' tiny llama
    # the texts' tokens, about one per 4 bytes (GGUF inputs: no tokenizer folder), each text one more
    assert first["tokens"] == sum(1 + -(-len(line.encode()) // 4) for line in TEXTS.splitlines())
    assert first["read_bytes"] > 0 and 0 < first["merge_share"] < 1  # the head is not read
    assert first["write_bytes"] >= layers * first["tokens"] * hidden * 4  # every layer's hidden states journaled
    assert first["held_bytes"] >= 2 * first["tokens"] * hidden * 4
    assert found["memory"]["first_pass_bytes"] == first["held_bytes"]
    assert found["memory"]["peak_bytes"] >= found["memory"]["baseline_bytes"] + first["held_bytes"]
    assert found["time"]["first_pass_seconds"] == pytest.approx(first["seconds"], abs=0.1)
    state_disk = next(d for d in found["disks"] if "state" in d["roles"])
    state_without = next(d for d in without["disks"] if "state" in d["roles"])
    # (the card, an aux file of the ledger, says more with the flag: a few hundred bytes)
    assert state_disk["needed_bytes"] == pytest.approx(state_without["needed_bytes"] + first["state_bytes"], abs=4096)
    text = cli("plan", config, tmp_path / "out", "--state-dir", state, *K_MIX, "--imatrix-texts", texts).stdout
    assert "the importance matrix pass over the merge (texts.txt, --imatrix-texts) first" in text, text
    assert not state.exists() or not (state / "imatrix").exists()  # plan computes nothing


def test_the_written_format_is_read_back_as_llama_quantize_applies_it(tmp_path: Path) -> None:
    """llama-imatrix's GGUF as resumerge writes it (an expert stack's entry a slice per expert, a count of 0
    kept), read back by gguf-py's reader and by resumerge's: each slice its sums over its count, all ones where
    the count is 0; two models' entries pooled add sums and counts."""
    from resumerge.forward.sums.imatrix import imatrix_file, pooled
    from resumerge.outputs.gguf.imatrix import ImatrixEntry

    sums = np.arange(12, dtype=np.float32).reshape(3, 4)
    entries = {"blk.0.ffn_down_exps.weight": ImatrixEntry(sums, np.array([2, 0, 4], dtype=np.float32)),
               "blk.0.attn_q.weight": ImatrixEntry(np.full((1, 4), 6, np.float32), np.array([3], np.float32))}
    both = pooled([entries, {"blk.0.attn_q.weight": ImatrixEntry(np.full((1, 4), 2, np.float32),
                                                                 np.array([1], np.float32))}])
    path = tmp_path / "m.gguf"
    path.write_bytes(imatrix_file(both, "texts.txt", 3))
    read = read_imatrix(path)
    assert np.array_equal(read["blk.0.ffn_down_exps.weight"], np.concatenate([sums[0] / 2, np.ones(4), sums[2] / 4]))
    assert np.array_equal(read["blk.0.attn_q.weight"], np.full(4, 2, np.float32))
    reader = gguf.GGUFReader(path)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml's ne order
    assert shapes["blk.0.ffn_down_exps.weight.in_sum2"] == (4, 3)
    assert shapes["blk.0.ffn_down_exps.weight.counts"] == (1, 3)
    assert reader.fields["imatrix.datasets"].contents() == ["texts.txt"]


def test_the_older_dat_form_is_written_as_llama_imatrix_writes_it_and_read_back(tmp_path: Path) -> None:
    """``.dat`` as llama-imatrix's ``--output-format dat`` writes it (``kquants.md`` §4), field by field: the entries
    sorted, ``ncall`` the largest count over the chunk size rounded up, each value ``(sum / count) * ncall`` in
    float32 (an expert never routed to: 1 for both), an entry never seen at all left out, then the chunk count and
    the dataset's name; read back by resumerge's reader as llama-quantize applies it (each value over ``ncall``):
    equal, to a float32 rounding, to the GGUF form's sums over counts. (llama.cpp's library, the test oracle, has
    no reader of either file: its quantizer is given the values.)"""
    import struct

    from resumerge.forward.sums.imatrix import imatrix_file
    from resumerge.outputs.gguf.imatrix import ImatrixEntry

    sums = (np.arange(12, dtype=np.float32).reshape(3, 4) + 1) * np.float32(0.7)
    entries = {"blk.0.ffn_down_exps.weight": ImatrixEntry(sums, np.array([5, 0, 9], dtype=np.float32)),
               "blk.0.attn_q.weight": ImatrixEntry(np.full((1, 4), 6.5, np.float32), np.array([13], np.float32)),
               "blk.1.ffn_gate_exps.weight": ImatrixEntry(np.zeros((2, 4), np.float32), np.zeros(2, np.float32))}
    dat, gguf_path = tmp_path / "m.dat", tmp_path / "m.gguf"
    dat.write_bytes(imatrix_file(entries, "texts.txt", 3, dat=True))
    gguf_path.write_bytes(imatrix_file(entries, "texts.txt", 3))
    data = dat.read_bytes()
    at = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal at
        found = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return found

    chunk = 5  # ceil(13 tokens / 3 texts)
    assert take("<i") == (2,)
    for name, count, want in (("blk.0.attn_q.weight", 13, np.full(4, 6.5, np.float32) / np.float32(13)),
                              ("blk.0.ffn_down_exps.weight", 9, np.concatenate(
                                  [sums[0] / np.float32(5), np.ones(4, np.float32), sums[2] / np.float32(9)]))):
        (length,) = take("<i")
        assert data[at:at + length].decode() == name
        at += length
        ncall, nval = take("<ii")
        assert (ncall, nval) == (-(-count // chunk), want.size)
        values = np.frombuffer(data, "<f4", nval, at)
        at += 4 * nval
        assert np.array_equal(values, want.astype(np.float32) * np.float32(ncall)), name
    (chunks, length), rest = take("<ii"), data[at:]
    assert (chunks, length, rest) == (3, 9, b"texts.txt")
    read, from_gguf = read_imatrix(dat), read_imatrix(gguf_path)
    assert sorted(read) == ["blk.0.attn_q.weight", "blk.0.ffn_down_exps.weight"]
    for name, values in read.items():
        assert np.allclose(values, from_gguf[name], rtol=1e-6, atol=0), name


def test_the_pass_runs_texts_on_two_threads_and_sums_the_bits_one_thread_sums(
        merge: tuple[Path, Path], computed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense layer's texts run on the pass's own two threads (the other core idled while the pass ran, the
    encoding waiting for its matrix), and the matrix has the bytes of the pass run on the calling thread alone: each
    text's squares are added in the texts' order, whichever thread ran it."""
    from resumerge.analyses.importance import sums
    from resumerge.forward.engine.stream import ModelStream

    config, texts = merge
    ran: list[str] = []
    real_run = ModelStream.run

    def run(*args: object, **kwargs: object) -> object:
        ran.append(threading.current_thread().name)
        return real_run(*args, **kwargs)  # type: ignore[arg-type]

    class OneThread:  # the executor's map on the calling thread
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> OneThread:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def map(self, fn: Callable[..., object], *iterables: Iterable[object]) -> Iterator[object]:
            return map(fn, *iterables)

    monkeypatch.setattr(ModelStream, "run", run)
    threaded = tmp_path / "threaded"
    api.run(config, threaded / "out", settings=api.Settings(state_dir=threaded / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    assert ran and all(name.startswith("resumerge-imatrix") for name in ran), ran
    monkeypatch.setattr(sums, "ThreadPoolExecutor", OneThread)
    alone = tmp_path / "alone"
    api.run(config, alone / "out", settings=api.Settings(state_dir=alone / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    (first,), (second,) = ((root / "s" / "imatrix").glob("*.gguf") for root in (threaded, alone))
    assert first.read_bytes() == second.read_bytes() == computed[1].read_bytes()
    assert _sha(threaded / "out" / "model.gguf") == _sha(alone / "out" / "model.gguf")


def test_the_pass_pairs_short_texts_only() -> None:
    """Two texts run at once only where both are short (their products and scores are held beside what the
    pass's guard counts): in order, a long text alone."""
    from resumerge.analyses.importance.sums import _PAIRED_TOKENS, _steps

    long = _PAIRED_TOKENS + 1
    assert _steps([3, 5, 7]) == [[0, 1], [2]]
    assert _steps([3, long, 5, 6, long]) == [[0], [1], [2, 3], [4]]
    assert _steps([]) == []


def test_the_next_layer_is_merged_while_one_runs_where_the_step_holds_it_and_the_bytes_stay(
        merge: tuple[Path, Path], computed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer l + 1's weights are merged on a thread of their own while layer l's texts run (the merge, on one core,
    held the forward back), where the pass's step has room for a layer beside it: the room kept for its largest
    merge (the embeddings', in the bench's 1 GB models), unused while a layer runs. The matrix and the GGUF keep the
    bytes of the pass that reads each layer as it loads (this tiny merge's step has no such room: ``computed``)."""
    from resumerge.analyses.importance import onmerge
    from resumerge.analyses.importance.ahead import ahead_fits
    from resumerge.forward.engine.reader import CastReader

    assert ahead_fits(10, 5, 15) and not ahead_fits(10, 6, 15)
    config, texts = merge
    reads: list[tuple[str, str]] = []
    real_read = CastReader.read

    def read(self: CastReader, name: str) -> object:
        reads.append((name, threading.current_thread().name))
        return real_read(self, name)

    monkeypatch.setattr(CastReader, "read", read)
    monkeypatch.setattr(onmerge, "ahead_fits", lambda layer, largest, room: True)
    ahead = tmp_path / "ahead"
    api.run(config, ahead / "out", settings=api.Settings(state_dir=ahead / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    by_layer = {layer: {thread for name, thread in reads if f".layers.{layer}." in name} for layer in range(LAYERS)}
    assert by_layer[0] == {"MainThread"}, by_layer  # the first layer is read as it loads
    assert all(threads and all(t.startswith("resumerge-ahead") for t in threads)
               for layer, threads in by_layer.items() if layer), by_layer
    (matrix,) = (ahead / "s" / "imatrix").glob("*.gguf")
    assert matrix.read_bytes() == computed[1].read_bytes()
    assert _sha(ahead / "out" / "model.gguf") == _sha(computed[0] / "model.gguf")


def test_torch_is_imported_beside_the_plan_of_a_run_with_a_pass(merge: tuple[Path, Path], tmp_path: Path) -> None:
    """The pass's forward needs torch (~1 CPU s to import): its import starts on a thread of its own before the
    merge is planned, not after (the planning holds no torch)."""
    config, texts = merge
    probe = (
        "import threading\n"
        "import resumerge.merge.engine.session as session\n"
        "from resumerge.cli.commands import main\n"
        "real, seen = session.prepare, []\n"
        "def prepare(*args, **kwargs):\n"
        "    seen.append(sorted(t.name for t in threading.enumerate()))\n"
        "    return real(*args, **kwargs)\n"
        "session.prepare = prepare\n"
        f"code = main(['run', {str(config)!r}, {str(tmp_path / 'out')!r}, '--state-dir', {str(tmp_path / 's')!r},\n"
        f"             *{K_MIX!r}, '--imatrix-texts', {str(texts)!r}, '--quiet'])\n"
        "print(code, 'resumerge-torch-import' in seen[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.stdout.strip().splitlines()[-1:] == ["0 True"], done.stdout + done.stderr[-3000:]
