"""The output containers and the codec directions, as values: what each answers, with no model built.

A container is chosen once from ``--out-type`` and owns what differs between output files (the fingerprint's
extras, the index, which side files, verify's rule); a stored format implements exactly the directions it has."""

from __future__ import annotations

import hashlib

import pytest

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
    from resumerge.merge.plan.merge_plan import PlanOptions

    assert container_for(PlanOptions()) == SAFETENSORS
    gguf = container_for(PlanOptions(out_type="gguf", gguf_type="q8_0", gguf_split_max_size=1 << 30))
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


def test_a_gguf_codec_answers_its_round_trip_error_and_other_formats_none() -> None:
    assert GgufCodec("Q4_1", (32, 20)).round_trip == ("Q4_1", 7.9)
    assert GgufOutCodec("blk.0.attn_q.weight", 8).round_trip == ("Q8_0", 0.54)
    assert GgufStackCodec("blk.0.ffn_gate_exps.weight", 2).round_trip == ("Q4_0", 8.6)
    # lossless enough, or not GGUF: nothing to note
    assert GgufCodec("F16", (1, 2)).round_trip is None and GgufOutCodec("output.weight", 1).round_trip is None
    assert PLAIN.round_trip is None and BlockFp8Codec((128, 128)).round_trip is None


def test_a_split_size_and_an_unwritten_merge_are_answered_by_the_container() -> None:
    from resumerge.api import Output, Settings
    from resumerge.api.options import plan_options
    from resumerge.api.unwritten import _options
    from resumerge.config.outformats import takes
    from resumerge.errors import UsageError

    assert (takes("gguf", "gguf_split_max_size"), takes("safetensors", "gguf_split_max_size")) == (True, False)
    assert (GgufFile.unwritten_reads, SafetensorsShards.unwritten_reads) == (False, True)
    split = Output(out_type="gguf", gguf_split_max_size="1MB")
    assert plan_options(split, out_shard_size=None).gguf_split_max_size == 1_000_000
    with pytest.raises(UsageError, match="splits a GGUF output"):
        plan_options(Output(gguf_split_max_size="1MB"), out_shard_size=None)
    assert _options(Settings(), "open_unwritten")[0].out_type == "safetensors"
    with pytest.raises(UsageError, match=r"an unwritten merge is read as safetensors, not .*gguf"):
        _options(Settings(output=Output(out_type="gguf")), "open_unwritten")
