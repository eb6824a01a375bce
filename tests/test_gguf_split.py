"""A GGUF output split as gguf-split splits it (``--gguf-split-max-size``): files ``model-0000i-of-0000N.gguf``, each a
complete GGUF holding the ``split.*`` keys (the first also every other key), together the unsplit output's tensors
byte for byte, and byte-equal to gguf-py's own writer splitting the same keys and tensors at the same size; a
damaged split is found by ``verify``; the flag is refused without ``--out-type gguf``. (A split output killed
anywhere resumes byte-identical: tests/test_gguf_outputs.py's kill test, parametrised.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from ggufmodels import Q, hf_tensors, linear_llama_config, to_gguf, write_gguf
from support import cli_here, write_config

from resumerge.merge.plan.ggufout import split_files
from resumerge.outputs.gguf.layout import TensorInfo

SPLIT = 40_000  # tensor bytes per split file: the tiny llama's 1.3 MB of Q8_0 in several files


def _merge(root: Path, *flags: str) -> Path:
    config = linear_llama_config(root)
    out = root / f"out{len(flags)}"
    done = cli_here("run", config, out, "--state-dir", root / f"s{len(flags)}", "--out-type", "gguf",
                    "--gguf-type", "q8_0", *flags)
    assert done.returncode == 0, done.stderr
    return out


def _keys(reader: gguf.GGUFReader) -> list[str]:
    return [k for k in reader.fields if not k.startswith("GGUF.")]


def _scalar(reader: gguf.GGUFReader, key: str) -> int:
    return int(reader.fields[key].parts[-1][0])


def test_a_split_gguf_output_is_gguf_split_s_files_of_the_unsplit_tensors(tmp_path: Path) -> None:
    whole = gguf.GGUFReader(_merge(tmp_path) / "model.gguf")
    out = _merge(tmp_path, "--gguf-split-max-size", str(SPLIT))
    files = sorted(out.glob("*.gguf"))
    count = len(files)
    assert count > 2 and [f.name for f in files] == [f"model-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    readers = [gguf.GGUFReader(f) for f in files]
    split_keys = ["split.no", "split.count", "split.tensors.count"]
    assert _keys(readers[0]) == _keys(whole) + split_keys  # the model's keys in the first file only
    seen = {}
    for i, reader in enumerate(readers):
        if i:
            assert _keys(reader) == split_keys
        assert [_scalar(reader, k) for k in split_keys] == [i, count, len(whole.tensors)]
        assert reader.fields["split.no"].types == [gguf.GGUFValueType.UINT16]
        assert reader.fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        held = sum(int(t.n_bytes) for t in reader.tensors)
        assert held <= SPLIT or len(reader.tensors) == 1
        seen.update({t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in reader.tensors})
    assert list(seen) == [t.name for t in whole.tensors]  # the unsplit order, cut into files
    for t in whole.tensors:
        assert seen[t.name] == (t.tensor_type, np.asarray(t.data).tobytes()), t.name

    # gguf-py's writer, given the unsplit file's keys and tensors and the same size, writes the same files
    writer = gguf.GGUFWriter(tmp_path / "py" / "model.gguf", "llama", split_max_size=SPLIT)
    (tmp_path / "py").mkdir()
    for key in _keys(whole):
        if key != "general.architecture":
            field = whole.fields[key]
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in whole.tensors:
        raw = np.asarray(t.data)
        writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert sorted(p.name for p in (tmp_path / "py").iterdir()) == [f.name for f in files]
    for f in files:
        assert (tmp_path / "py" / f.name).read_bytes() == f.read_bytes(), f.name


def test_split_files_cut_as_gguf_py_s_writer_does() -> None:
    infos = [TensorInfo(str(i), (1,), 0, n) for i, n in enumerate([10, 10, 25, 5, 5, 30, 1])]
    assert [[t.nbytes for t in g] for g in split_files(infos, 20)] == [[10, 10], [25], [5, 5], [30], [1]]
    assert len(split_files(infos, None)) == 1


def test_a_damaged_split_is_found_by_verify(tmp_path: Path) -> None:
    out = _merge(tmp_path, "--gguf-split-max-size", str(SPLIT))
    second = sorted(out.glob("*.gguf"))[1]
    data = bytearray(second.read_bytes())
    data[-40] ^= 1
    second.write_bytes(bytes(data))
    done = cli_here("verify", out, "--state-dir", tmp_path / "s2")
    assert done.returncode != 0 and second.name in done.stdout + done.stderr


def test_a_split_size_without_a_gguf_output_is_refused(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a.gguf", "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(tmp_path / "a.gguf"), "parameters": {"weight": 1.0}}]})
    done = cli_here("run", config, tmp_path / "out", "--gguf-split-max-size", "1GB")
    assert done.returncode == 2 and "--out-type gguf" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
