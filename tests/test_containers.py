"""The output containers and the codec directions, as values: what each answers, with no model built.

A container is chosen once from ``--out-type`` and owns what differs between output files (the fingerprint's
extras, the index, which side files, verify's rule); a stored format implements exactly the directions it has."""

from __future__ import annotations

import hashlib

from resumerge.inputs.codecs import (
    PLAIN,
    BlockFp8Codec,
    CompressedTensorsCodec,
    Mxfp4Codec,
    TensorDecoder,
    TensorEncoder,
)
from resumerge.inputs.gguf.codec import GgufCodec
from resumerge.outputs.containers import (
    SAFETENSORS,
    GgufFile,
    PeftAdapter,
    SafetensorsShards,
    container_for,
    container_of,
)
from resumerge.outputs.gguf import GgufOutCodec, GgufStackCodec


def test_each_container_answers_for_its_own_files() -> None:
    assert container_for("safetensors") == SAFETENSORS
    gguf = container_for("gguf", gguf_type="q8_0", split_max_size=1 << 30)
    assert gguf == GgufFile("q8_0", 1 << 30) and gguf.self_contained and not gguf.loader_readable
    # a merge's fingerprint gains nothing; a GGUF's headers and an adapter's side files are hashed into it
    assert SAFETENSORS.fingerprint_extras() == {} == PeftAdapter().fingerprint_extras()
    header = b"GGUF header"
    assert GgufFile(headers={"model.gguf": header}).fingerprint_extras() == {
        "gguf_headers": {"model.gguf": hashlib.sha256(header).hexdigest()}}
    assert PeftAdapter({"adapter_config.json": b"{}"}).side_files() == {"adapter_config.json": b"{}"}
    assert SAFETENSORS.writes_index(2) and not SAFETENSORS.writes_index(1) and not gguf.writes_index(3)
    assert SAFETENSORS.card_tags == () and gguf.card_tags == ("gguf",) and SAFETENSORS.card_lines(["a"], {}) == []
    assert gguf.tokenizer_note() == "tokenizer in the GGUF" and SAFETENSORS.tokenizer_note() is None
    assert "gguf-split" in (gguf.files_fact() or "") and GgufFile().files_fact() == "one GGUF file"
    # verify tells a run's container from its committed files
    assert container_of(["model-00001-of-00002.gguf", "README.md"]) is GgufFile
    assert container_of(["model.safetensors", "config.json"]) is SafetensorsShards


def test_a_format_implements_the_directions_it_has_and_no_other() -> None:
    both = (PLAIN, BlockFp8Codec((128, 128)), Mxfp4Codec())
    assert all(isinstance(c, TensorDecoder) and isinstance(c, TensorEncoder) for c in both)
    assert issubclass(CompressedTensorsCodec, TensorDecoder) and issubclass(CompressedTensorsCodec, TensorEncoder)
    assert issubclass(GgufCodec, TensorDecoder) and not issubclass(GgufCodec, TensorEncoder)
    for written in (GgufOutCodec, GgufStackCodec):
        assert issubclass(written, TensorEncoder) and not issubclass(written, TensorDecoder)
