"""The safetensors layer: byte-exact layout against the safetensors library, and hostile headers refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from resumerge.errors import HostileFileError
from resumerge.inputs.safetensors_format import layout_shard, read_header, shard_extent
from resumerge.inputs.tensorio import TensorReader, tensor_bytes

CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
         torch.float64: "F64", torch.int8: "I8", torch.bool: "BOOL", torch.uint8: "U8", torch.int16: "I16",
         torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _write_like_resumerge(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    layout = layout_shard({n: (CODES[t.dtype], tuple(t.shape)) for n, t in tensors.items()})
    with open(path, "wb") as f:
        f.write(layout.header)
        for planned in layout.order:
            f.write(tensor_bytes(tensors[planned.name].contiguous()))


names = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(names, st.tuples(st.sampled_from(list(CODES)), st.lists(st.integers(0, 4), max_size=3)),
                       min_size=1, max_size=6))
def test_layout_is_byte_identical_to_safetensors(tmp_path_factory: pytest.TempPathFactory,
                                                 spec: dict[str, tuple[torch.dtype, list[int]]]) -> None:
    tmp = tmp_path_factory.mktemp("st")
    tensors = {n: torch.zeros(shape).to(dt) for n, (dt, shape) in spec.items()}
    save_file(tensors, str(tmp / "ref.safetensors"), metadata={"format": "pt"})
    _write_like_resumerge(tmp / "ours.safetensors", tensors)
    ref = (tmp / "ref.safetensors").read_bytes()
    assert (tmp / "ours.safetensors").read_bytes() == ref
    # What the planner sizes shards with: the same order and the file's size.
    layout = layout_shard({n: (CODES[t.dtype], tuple(t.shape)) for n, t in tensors.items()})
    assert shard_extent({n: (CODES[t.dtype], tuple(t.shape)) for n, t in tensors.items()}) == (
        [t.name for t in layout.order], len(ref))


def test_reader_round_trips_every_dtype(tmp_path: Path) -> None:
    tensors = {f"t{i}": (torch.randn(3, 5) * 10).to(dt) for i, dt in enumerate(CODES)}
    tensors = {n: t for n, t in tensors.items() if not t.dtype.is_floating_point or t.dtype.itemsize > 1}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    header = read_header(tmp_path / "x.safetensors")
    reader = TensorReader()
    for name, entry in header.tensors.items():
        got = reader.read(tmp_path / "x.safetensors", entry.start, entry.end, entry.dtype, entry.shape)
        assert torch.equal(got, tensors[name])
    reader.close()


def _raw(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "fragment"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 2**40, "header length"),
        (b"not json at all", b"", None, "not valid JSON"),
        (b"[1, 2, 3]", b"", None, "not a JSON object"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlaps"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "gap"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "covers"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "need 12"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape"),
        ({"a\u0000b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "NUL"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "data_offsets"),
    ],
)
def test_hostile_headers_are_refused(tmp_path: Path, header: object, data: bytes, length: int | None,
                                     fragment: str) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(HostileFileError, match=fragment):
        read_header(path)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(100)}, str(tmp_path / "x.safetensors"))
    blob = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(blob[:-3])
    with pytest.raises(HostileFileError, match="covers"):
        read_header(tmp_path / "x.safetensors")
