"""The importance matrix resumerge computes on a merge never written (``run --imatrix-texts``) against
llama-imatrix's own accumulation on the written merge (issue 84): llama.cpp's library (the test-only oracle of
``tests/llamacpp_oracle.py``) runs its forward on the F32 GGUF resumerge wrote of the same merge over the very token
ids resumerge read, and ``cb_eval`` (the scheduler hook llama-imatrix registers) sums each MUL_MAT's input columns'
squares as llama-imatrix does. Skipped where the library does not load.

llama-imatrix itself cuts one text file into chunks of ``n_ctx`` tokens, each begun by BOS; resumerge runs each line
as its own sequence. With the same sequences fed to both, the sums are the same: that is what is compared here, and
every text is at least 16 tokens long because llama-imatrix skips smaller batches."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from llamacpp_oracle import imatrix_of_forward, needs_library
from support import write_config

from resumerge import api

TEXTS = ("the cat sat on the mat and the dog sat on the log.\nthree plus four is seven and two plus two is four.\n"
         "abc def ghi 123 456 789 jkl mno pqr stu\n")


def _raw(matrix: Path) -> dict[str, tuple[np.ndarray, float]]:
    """A GGUF importance matrix's entries as written: per weight, its sums of squares and its count."""
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(matrix).tensors}
    return {name.removesuffix(".in_sum2"): (values.reshape(-1), float(tensors[name.replace(".in_sum2", ".counts")]
                                                                       .reshape(-1)[0]))
            for name, values in tensors.items() if name.endswith(".in_sum2")}


def test_the_matrix_computed_on_the_unwritten_merge_is_llama_imatrix_s_on_the_written_one(tmp_path: Path) -> None:
    """Per weight of the decoder blocks: the same entries, the same count (every token of every text), and sums of
    squares equal to float32 tolerance to what llama.cpp's forward of the written F32 GGUF shows llama-imatrix's
    callback over the same token ids."""
    needs_library()
    from resumerge.forward.texts import context_of, load_tokenizer, sequences

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
    write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.F32)
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    api.run(config, tmp_path / "q4", settings=api.Settings(state_dir=tmp_path / "s", output=api.Output(
        out_type="gguf", gguf_type="q4_k_m", imatrix_texts=texts)))
    (matrix,) = (tmp_path / "s" / "imatrix").glob("*.gguf")
    ours = _raw(matrix)
    # The merge written: as F32 GGUF for llama.cpp, as safetensors for the tokenizer resumerge's pass read.
    api.run(config, tmp_path / "f32", settings=api.Settings(state_dir=tmp_path / "s2", output=api.Output(
        out_type="gguf", gguf_type="f32")))
    api.run(config, tmp_path / "st", settings=api.Settings(state_dir=tmp_path / "s3"))
    tokenizer = load_tokenizer([tmp_path / "st"], plain=True)
    ids = sequences(tokenizer, texts, context_of([]), option="--imatrix-texts")
    assert len(ids) == 3 and min(map(len, ids)) >= 16
    theirs = imatrix_of_forward(tmp_path / "f32" / "model.gguf", ids)
    assert sorted(ours) == sorted(theirs) and len(theirs) == 14
    tokens = sum(map(len, ids))
    for name, (sums, count) in theirs.items():
        mine, my_count = ours[name]
        assert count == my_count == tokens, name
        assert np.allclose(mine, sums, rtol=2e-4, atol=1e-6 * float(sums.max())), (
            name, float(np.max(np.abs(mine - sums) / np.maximum(np.abs(sums), 1e-6))))


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
    assert {count for _, count in found.values()} == {16} and len(found) == 14
