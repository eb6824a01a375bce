"""llama.cpp's own library as a test-only oracle (``shared/reference/kquants.md`` §6): PyPI ``llama-cpp-py-sync``
ships ``libggml-base`` (``ggml_quantize_chunk``) and ``libllama`` (``llama_model_quantize``).

Its libraries import ``__isoc23_strtol`` (and ``strtoul``, ``strtoull``, ``sscanf``) at ``GLIBC_2.38``, so they do not
load on an older glibc (Debian 12's 2.36). :func:`library` loads patched copies from a temporary folder: the C23
names renamed to the classic functions in ``.dynstr`` (they differ only in accepting ``0b`` literals, which the
library never parses here), those symbols unversioned in ``.gnu.version`` and the ``GLIBC_2.38`` need marked weak.
On a glibc of 2.38 or later the patch changes nothing that matters. Never used by resumerge itself.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

_LIBS = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml-rpc.so.0", "libggml.so.0", "libllama.so.0")
_C23 = b"__isoc23_"
_VER_FLG_WEAK = 2


def _patch(path: Path) -> None:
    """``path`` (an ELF64 little-endian shared library) made loadable on glibc < 2.38, in place."""
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in sections}
    dynsym = by_type[11]  # SHT_DYNSYM
    dynstr = sections[dynsym[6]]
    versym = by_type.get(0x6FFFFFFF)  # SHT_GNU_versym
    verneed = by_type.get(0x6FFFFFFE)  # SHT_GNU_verneed
    str_at = dynstr[4]

    def name_at(offset: int) -> bytes:
        end = data.index(0, str_at + offset)
        return bytes(data[str_at + offset:end])

    for i in range(dynsym[5] // 24):
        name_offset, = struct.unpack_from("<I", data, dynsym[4] + i * 24)
        name = name_at(name_offset)
        if name.startswith(_C23):
            short = name[len(_C23):] + b"\0"
            data[str_at + name_offset:str_at + name_offset + len(short)] = short
            if versym is not None:
                struct.pack_into("<H", data, versym[4] + 2 * i, 1)  # VER_NDX_GLOBAL
    if verneed is not None:
        at = verneed[4]
        while True:
            _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, at)
            aux_at = at + aux
            for _ in range(cnt):
                _, flags, _, vname, anext = struct.unpack_from("<IHHII", data, aux_at)
                if name_at(vname) == b"GLIBC_2.38":
                    struct.pack_into("<H", data, aux_at + 4, flags | _VER_FLG_WEAK)
                aux_at += anext
            if not nxt:
                break
            at += nxt
    path.write_bytes(bytes(data))


@functools.cache
def library() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """(libggml-base, libllama) loaded, or None where the wheel is not installed or does not load."""
    try:
        import llama_cpp_py_sync
    except ImportError:
        return None
    shipped = Path(llama_cpp_py_sync.__file__).parent
    folder = Path(tempfile.mkdtemp(prefix="llamacpp-oracle-"))
    loaded = []
    try:
        for name in _LIBS:
            if not (shipped / name).exists():
                continue
            shutil.copyfile(shipped / name, folder / name)
            _patch(folder / name)
            loaded.append(ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL))
    except OSError:
        return None
    finally:  # the loaded libraries stay mapped
        shutil.rmtree(folder, ignore_errors=True)
    base, llama = loaded[0], loaded[-1]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return base, llama


def needs_library() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The oracle's libraries, or the test skipped where they do not load."""
    found = library()
    if found is None:
        pytest.skip("llama.cpp's library (llama-cpp-py-sync, the test extra) does not load here")
    return found


def quantize(values: np.ndarray, ggml_type: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's bytes of ``values`` (float32 rows) as ``ggml_type`` (``ggml_quantize_chunk``), with the
    per-column importance ``imatrix`` (None: without one): uint8, one row of bytes per row."""
    base, _ = needs_library()
    rows = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, values.shape[-1])
    n_rows, n_per_row = rows.shape
    row_bytes = base.ggml_row_size(ggml_type, n_per_row)
    out = np.zeros((n_rows, row_bytes), dtype=np.uint8)
    weights = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    written = base.ggml_quantize_chunk(ggml_type, rows.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row,
                                       None if weights is None else weights.ctypes.data)
    assert written == out.nbytes
    return out.reshape(*values.shape[:-1], row_bytes)


class _Params(ctypes.Structure):
    """``llama_model_quantize_params`` of the pinned wheel (64 bytes, kquants.md §6)."""

    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
                ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]


class _Imatrix(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.POINTER(ctypes.c_float)), ("size", ctypes.c_size_t)]


class _TensorType(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("type", ctypes.c_int)]


def quantize_model(src: Path, dst: Path, ftype: int, *, imatrix: dict[str, np.ndarray] | None = None,
                   tensor_types: tuple[tuple[str, int], ...] = (), output_type: int = -1,
                   token_embedding_type: int = -1) -> None:
    """llama-quantize ``src`` (a GGUF) into ``dst`` as file type ``ftype`` (``llama_model_quantize``), with the
    per-tensor importance ``imatrix`` (values as llama-quantize passes them: sums over counts), ``--tensor-type``
    pairs and the output / token embedding types (-1: unset)."""
    _, llama = needs_library()
    assert ctypes.sizeof(_Params) == 64
    llama.llama_model_quantize_default_params.restype = _Params
    llama.llama_model_quantize.restype = ctypes.c_uint32
    llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params)]
    params = llama.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if output_type >= 0:
        params.output_tensor_type = output_type
    if token_embedding_type >= 0:
        params.token_embedding_type = token_embedding_type
    keep: list[object] = []  # the buffers the library reads, alive until it returns
    if imatrix is not None:
        entries = (_Imatrix * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            data = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(data)
            entries[i] = _Imatrix(name.encode(), data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), data.size)
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.c_void_p)
    if tensor_types:
        pairs = (_TensorType * (len(tensor_types) + 1))()
        for i, (pattern, kind) in enumerate(tensor_types):
            pairs[i] = _TensorType(pattern.encode(), kind)
        keep.append(pairs)
        params.tt_overrides = ctypes.cast(pairs, ctypes.c_void_p)
    if llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")
