"""The importance matrix resumerge computes on a merge never written (``run --imatrix-texts``) against
llama-imatrix's own accumulation on the written merge (issue 84): llama.cpp's library (the test-only oracle of
``tests/llamacpp_oracle.py``) runs its forward on the F32 GGUF resumerge wrote of the same merge over the very token
ids resumerge read, and ``cb_eval`` (the scheduler hook llama-imatrix registers) sums each MUL_MAT's input columns'
squares as llama-imatrix does: each MUL_MAT's rows, and for a mixture's experts (MUL_MAT_ID) each expert's
tokens as the ids its router chose, counted per expert. Skipped where the library does not load.

llama-imatrix itself cuts one text file into chunks of ``n_ctx`` tokens, each begun by BOS; resumerge runs each line
as its own sequence. With the same sequences fed to both, the sums are the same: that is what is compared here, and
every text is at least 16 tokens long because llama-imatrix skips smaller batches."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from ggufmodels import EXPERTS, LAYERS, Q, hf_tensors, to_gguf, write_gguf
from llamacpp_oracle import imatrix_of_forward, needs_library, tokenize
from support import write_config

from resumerge import api
from resumerge.inputs.gguf.header import read_gguf_header
from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

TEXTS = ("the cat sat on the mat and the dog sat on the log.\nthree plus four is seven and two plus two is four.\n"
         "abc def ghi 123 456 789 jkl mno pqr stu\n")


def _raw(matrix: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A GGUF importance matrix's entries as written: per weight, its sums of squares [n_mat, n_in] and its counts
    [n_mat] (one matrix for a dense weight, one per expert for a stack)."""
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(matrix).tensors}
    raw = {}
    for name, values in tensors.items():
        if name.endswith(".in_sum2"):
            counts = tensors[name.replace(".in_sum2", ".counts")].reshape(-1)
            raw[name.removesuffix(".in_sum2")] = values.reshape(counts.size, -1), counts
    return raw


Both = tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, tuple[np.ndarray, np.ndarray]], int]


@pytest.fixture(scope="module")
def llama_both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Both, Path]:
    """:func:`_both` of the tiny llama merge and its folder, made once for the module's two tests that read them
    (no test writes there)."""
    folder = tmp_path_factory.mktemp("llama-both")
    return _both(folder, "llama"), folder


def _both(tmp_path: Path, arch: str) -> Both:
    """(the matrix ``run --imatrix-texts`` computed on a float32 linear merge of two tiny ``arch`` GGUFs never
    written, llama-imatrix's accumulation of llama.cpp's forward of that merge written as F32 GGUF over the token ids
    resumerge's pass read, the number of those tokens)."""
    from resumerge.forward.text.texts import context_of, load_tokenizer, sequences

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, arch, to_gguf(arch, hf_tensors(arch, seed=1)), Q.F32)
    write_gguf(b, arch, to_gguf(arch, hf_tensors(arch, seed=2)), Q.F32)
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    api.run(config, tmp_path / "q4", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    (matrix,) = (tmp_path / "s" / "imatrix").glob("*.gguf")
    # The merge written as F32 GGUF for llama.cpp; the tokenizer resumerge's pass read: the files the plan holds,
    # rebuilt from the first parent's key-values (kept by its header as the run kept them: read back, not rebuilt;
    # a safetensors run of the merge writes those very files).
    api.run(config, tmp_path / "f32", settings=api.Settings(state_dir=tmp_path / "s2", output=api.Output(
        out_type="gguf", gguf_type="f32")))
    (tmp_path / "st").mkdir()
    header = read_gguf_header(a, {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()})
    for name, data in gguf_tokenizer_files(a, header).items():
        (tmp_path / "st" / name).write_bytes(data)
    tokenizer = load_tokenizer([tmp_path / "st"], plain=True)
    ids = sequences(tokenizer, texts, context_of([]), option="--imatrix-texts")
    assert len(ids) == 3 and min(map(len, ids)) >= 16
    return _raw(matrix), imatrix_of_forward(tmp_path / "f32" / "model.gguf", ids), sum(map(len, ids))


def _sums_agree(name: str, mine: np.ndarray, sums: np.ndarray) -> None:
    """Float32 sums of the same squares in another order (and of activations computed in another order)."""
    assert mine.shape == sums.shape, name
    assert np.allclose(mine, sums, rtol=2e-4, atol=1e-6 * float(sums.max())), (
        name, float(np.max(np.abs(mine - sums) / np.maximum(np.abs(sums), 1e-6))))


def test_the_matrix_computed_on_the_unwritten_merge_is_llama_imatrix_s_on_the_written_one(
        llama_both: tuple[Both, Path]) -> None:
    """Per weight of the decoder blocks: the same entries, the same count (every token of every text), and sums of
    squares equal to float32 tolerance to what llama.cpp's forward of the written F32 GGUF shows llama-imatrix's
    callback over the same token ids."""
    needs_library()
    (ours, theirs, tokens), _ = llama_both
    assert sorted(ours) == sorted(theirs) and len(theirs) == 14
    for name, (sums, counts) in theirs.items():
        mine, my_counts = ours[name]
        assert counts.tolist() == my_counts.tolist() == [tokens], name
        _sums_agree(name, mine, sums)


def test_each_expert_s_entry_is_llama_imatrix_s_on_the_written_mixture(tmp_path: Path) -> None:
    """A mixture of experts (Qwen3-MoE: 3 experts, 2 a token): llama.cpp runs the experts as MUL_MAT_ID on the
    stacked ``ffn_{gate,up,down}_exps``, and llama-imatrix counts each expert's tokens from the ids its router
    chose. The matrix resumerge computed on the merge never written holds the same entries (attention, routers and
    the three stacks of each layer), each stack's per-expert counts identical to llama.cpp's routing of the same
    tokens (every expert chosen, two choices a token), and every expert's sums equal to float32 tolerance."""
    needs_library()
    ours, theirs, tokens = _both(tmp_path, "qwen3moe")
    assert sorted(ours) == sorted(theirs)
    stacks = [name for name in theirs if "_exps." in name]
    assert len(stacks) == 3 * LAYERS and len(theirs) == 8 * LAYERS  # q k v output, router, gate up down
    for name, (sums, counts) in theirs.items():
        mine, my_counts = ours[name]
        if name in stacks:
            assert counts.size == EXPERTS and counts.sum() == 2 * tokens and counts.min() > 0, (name, counts)
        else:
            assert counts.tolist() == [tokens], name
        assert my_counts.tolist() == counts.tolist(), name
        _sums_agree(name, mine, sums)


def test_the_oracle_s_pass_as_the_peer_runs_it_gives_the_same_matrix(llama_both: tuple[Both, Path]) -> None:
    """The oracle as ``bench/bench_kquant_route.py`` runs the peer's pass: the texts tokenized by llama.cpp's own
    tokenizer from the GGUF's vocabulary (llama-imatrix's ``common_tokenize``) into the very ids resumerge's pass
    read; the forward on two threads (llama-imatrix's default, every hardware thread) summing the same squares
    bit for bit as on one, the seconds its Python callback took reported; and the texts decoded together as
    sequences of one batch (llama-imatrix's parallel chunks) giving the same entries and counts, the sums to
    float32 tolerance, with fewer decodes than texts."""
    needs_library()
    (_, theirs, _), tmp_path = llama_both
    from resumerge.forward.text.texts import context_of, load_tokenizer, sequences

    model = tmp_path / "f32" / "model.gguf"
    read = sequences(load_tokenizer([tmp_path / "st"], plain=True), tmp_path / "texts.txt", context_of([]),
                     option="--imatrix-texts")
    ids = tokenize(model, [line for line in TEXTS.splitlines() if line.strip()])
    assert ids == read
    spent: list[float] = []
    two = imatrix_of_forward(model, ids, n_threads=2, spent=spent)
    assert len(spent) == 1 and spent[0] > 0
    assert sorted(two) == sorted(theirs)
    for name, (sums, counts) in theirs.items():
        assert np.array_equal(two[name][0], sums) and np.array_equal(two[name][1], counts), name
    together = imatrix_of_forward(model, ids, batch_tokens=2048)
    assert sorted(together) == sorted(theirs)
    for name, (sums, counts) in theirs.items():
        assert np.array_equal(together[name][1], counts), name
        _sums_agree(name, together[name][0], sums)
    # two texts of 15 tokens: alone each is under llama-imatrix's 16-token batch, together they count
    assert imatrix_of_forward(model, [ids[0][:15], ids[1][:15]]) == {}
    paired = imatrix_of_forward(model, [ids[0][:15], ids[1][:15]], batch_tokens=30)
    assert {tuple(counts) for _, counts in paired.values()} == {(30,)} and len(paired) == len(theirs)


def test_the_oracle_skips_what_llama_imatrix_skips(tmp_path: Path) -> None:
    """The oracle's own rule (the test above would pass vacuously without it): a sequence shorter than 16 tokens
    adds nothing, as llama-imatrix ignores batches under 16 tokens; 16 tokens add 16 rows to every block weight."""
    needs_library()
    model = tmp_path / "m.gguf"
    api_in = tmp_path / "a.gguf"
    write_gguf(api_in, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
    config = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "dtype": "float32",
                                              "models": [{"model": str(api_in)}]})
    api.run(config, tmp_path / "f32", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="f32")))
    model = tmp_path / "f32" / "model.gguf"
    assert imatrix_of_forward(model, [list(range(15))]) == {}
    found = imatrix_of_forward(model, [list(range(16))])
    assert {tuple(counts) for _, counts in found.values()} == {(16,)} and len(found) == 14


def test_the_oracle_counts_the_experts_of_every_batch_as_llama_imatrix_does(tmp_path: Path) -> None:
    """The oracle's rule for a MUL_MAT_ID (llama-imatrix asks for every one, whatever its batch): 15 tokens through
    a tiny Qwen3-MoE add nothing to the dense weights but count each token twice (two experts chosen) in each expert
    stack, the down stack's rows its own (one per choice), and each expert's row sums only the tokens routed to it."""
    needs_library()
    model = tmp_path / "m.gguf"
    write_gguf(model, "qwen3moe", to_gguf("qwen3moe", hf_tensors("qwen3moe", seed=1)), Q.F32)
    short = imatrix_of_forward(model, [list(range(15))])
    stacks = (f"blk.{i}.ffn_{p}_exps.weight" for i in range(LAYERS) for p in ("gate", "up", "down"))
    assert sorted(short) == sorted(stacks)
    for name, (sums, counts) in short.items():
        assert sums.shape == (EXPERTS, 512 if "down" in name else 256) and counts.sum() == 2 * 15, name
        assert np.array_equal(sums.any(axis=1), counts > 0), name
    (gate, routed), (up, _), (down, _) = (short[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    assert np.array_equal(gate, up) and not np.allclose(gate, down[:, :256])  # gate/up share their input row
    assert routed.tolist() == short["blk.0.ffn_down_exps.weight"][1].tolist()
