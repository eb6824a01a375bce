"""GGUF in and out, as merges take them: a GGUF MODEL or DONOR gives the transplant a folder of its decoded tensors
and rebuilt tokenizer gives, and ``--out-type gguf`` writes one GGUF holding DONOR's GGUF vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from ggufmodels import Q, decoded, hf_tensors, to_gguf, write_gguf
from safetensors.torch import save_file
from support import output_tensors

from resumerge import api
from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files
from transplant.pairs import make_pair


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, installation_cache: Path) -> tuple[Path, Path, Path, Path]:
    """(MODEL, DONOR: tiny llamas of two WordLevel tokenizers; a llama GGUF; a folder of what it decodes to). The
    folder's tokenizer files are rebuilt by the GGUF's header into the session's cache, where the transplants' own
    plans of the GGUF read them (one rebuild, not two: without the header nothing is kept)."""
    root = tmp_path_factory.mktemp("gguf")
    model, donor = make_pair(root, model_hidden=256)
    path = root / "m.gguf"
    write_gguf(path, "llama", to_gguf("llama", hf_tensors("llama")), Q.F32)
    opened, values = decoded(path)
    folder = root / "folder"
    folder.mkdir()
    save_file({name: value.contiguous() for name, value in values.items()}, str(folder / "model.safetensors"))
    config = {k: v for k, v in opened.config.items() if k != "quantization_config"}
    (folder / "config.json").write_text(json.dumps(config))
    for name, data in gguf_tokenizer_files(path, opened.gguf_header, installation_cache / "resumerge").items():
        (folder / name).write_bytes(data)
    return model, donor, path, folder



def _same(a: Path, b: Path) -> None:
    ours, theirs = output_tensors(a), output_tensors(b)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_a_gguf_model_or_donor_transplants_as_its_decoded_folder(files: tuple[Path, Path, Path, Path],
                                                                   tmp_path: Path) -> None:
    model, donor, path, folder = files
    surgery = api.Surgery(approximation_method="mean")
    for name, (mine, theirs), (as_folder, their_folder) in (
            ("model", (path, donor), (folder, donor)), ("donor", (model, path), (model, folder))):
        api.tokensurgeon(str(mine), str(theirs), tmp_path / name, surgery=surgery,
                         settings=api.Settings(state_dir=tmp_path / "s"))
        api.tokensurgeon(str(as_folder), str(their_folder), tmp_path / f"{name}-folder", surgery=surgery,
                         settings=api.Settings(state_dir=tmp_path / "s"))
        _same(tmp_path / name, tmp_path / f"{name}-folder")
    assert "quantization_config" not in json.loads((tmp_path / "model" / "config.json").read_text())


def test_a_gguf_output_holds_the_gguf_donors_vocabulary(files: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    model, _, path, _ = files
    out = tmp_path / "out"
    api.tokensurgeon(str(model), str(path), out, surgery=api.Surgery(approximation_method="mean"),
                     settings=api.Settings(output=api.Output(out_type="gguf", gguf_type="q8_0"),
                                           state_dir=tmp_path / "s"))
    written, parent = gguf.GGUFReader(out / "model.gguf"), gguf.GGUFReader(path)
    tokens = written.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]) for i in tokens.data] == [
        bytes(parent.fields["tokenizer.ggml.tokens"].parts[i]) for i in parent.fields["tokenizer.ggml.tokens"].data]
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in written.tensors}
    rows = len(parent.fields["tokenizer.ggml.tokens"].data)
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (256, rows)
    embed = next(t for t in written.tensors if t.name == "token_embd.weight")
    assert np.isfinite(np.asarray(embed.data, dtype=np.float32)).all()
    assert not (out / "tokenizer.json").exists()  # the file holds the tokenizer
    # the card's command line asks for the GGUF it describes
    assert f"`resumerge tokensurgeon {model} {path} OUT -a mean --out-type gguf --gguf-type q8_0`" in (
        out / "README.md").read_text()
