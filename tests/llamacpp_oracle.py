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
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gguf
import llamacpp_grids
import numpy as np
import pytest

_GRID_TYPES = frozenset({16, 17, 19, 22, 29})  # IQ2_XXS, IQ2_XS, IQ1_S, IQ2_S, IQ1_M: tests/llamacpp_grids.py
_LIBS = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml-rpc.so.0", "libggml.so.0", "libllama.so.0")
_C23 = b"__isoc23_"
_VER_FLG_WEAK = 2


def _patch(path: Path) -> None:
    """``path`` (an ELF64 little-endian shared library) made loadable on glibc < 2.38, in place."""
    data = bytearray(path.read_bytes())
    sections = llamacpp_grids.sections(data)
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
    llamacpp_grids.restore(shipped / _LIBS[0], base)  # the 1- and 2-bit grids this machine's library built before
    return base, llama


def _keep_grids() -> None:
    """The 1- and 2-bit grids the library built in this process kept for the next (tests/llamacpp_grids.py)."""
    import llama_cpp_py_sync

    base, _ = needs_library()
    llamacpp_grids.keep(Path(llama_cpp_py_sync.__file__).parent / _LIBS[0], base)


def grids_held(slot: int) -> str | None:
    """The digest of the 1- or 2-bit grid tables of ``iq2_data[slot]`` the library holds now (tests/llamacpp_grids.py;
    None before it has them)."""
    import llama_cpp_py_sync

    base, _ = needs_library()
    return llamacpp_grids.held(Path(llama_cpp_py_sync.__file__).parent / _LIBS[0], base, slot)


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
    if ggml_type in _GRID_TYPES:
        _keep_grids()
    return out.reshape(*values.shape[:-1], row_bytes)


class _TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h); :func:`dequantize` checks its name and sizes against the type."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def dequantize(stored: np.ndarray, ggml_type: int) -> np.ndarray:
    """llama.cpp's own float32 values of block bytes ``stored`` (uint8 rows) of ``ggml_type`` (its type traits'
    ``to_float``): one row of values per row."""
    base, _ = needs_library()
    base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    traits = base.ggml_get_type_traits(ggml_type).contents
    assert traits.type_size == base.ggml_row_size(ggml_type, traits.blck_size), traits.type_name
    rows = np.ascontiguousarray(stored, dtype=np.uint8).reshape(-1, stored.shape[-1])
    n = rows.shape[1] // traits.type_size * traits.blck_size
    out = np.zeros((rows.shape[0], n), dtype=np.float32)
    _TO_FLOAT(traits.to_float)(rows.ctypes.data, out.ctypes.data, out.size)
    return out.reshape(*stored.shape[:-1], n)


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


class _KvValue(ctypes.Union):
    _fields_ = [("val_i64", ctypes.c_int64), ("val_f64", ctypes.c_double), ("val_bool", ctypes.c_bool),
                ("val_str", ctypes.c_char * 128)]


class _KvOverride(ctypes.Structure):
    """``llama_model_kv_override``: ``tag`` (0 int, 1 float, 2 bool, 3 str), ``key``, the value."""

    _fields_ = [("tag", ctypes.c_int), ("key", ctypes.c_char * 128), ("value", _KvValue)]


_KV_TAGS = {"int": 0, "float": 1, "bool": 2, "str": 3}


def quantize_model(src: Path, dst: Path, ftype: int, *, imatrix: dict[str, np.ndarray] | None = None,
                   tensor_types: tuple[tuple[str, int], ...] = (), output_type: int = -1,
                   token_embedding_type: int = -1, nthread: int = 1, pure: bool = False,
                   kv_overrides: tuple[tuple[str, str, int | float | bool | str], ...] = ()) -> None:
    """llama-quantize ``src`` (a GGUF) into ``dst`` as file type ``ftype`` (``llama_model_quantize``), with the
    per-tensor importance ``imatrix`` (values as llama-quantize passes them: sums over counts), ``--tensor-type``
    pairs and the output / token embedding types (-1: unset), ``--pure``, ``--override-kv`` triples (key, ``int``
    ``float`` ``bool`` or ``str``, value: the ``llama_model_kv_override`` entries llama-quantize passes, its own
    ``quantize.imatrix.*`` keys among them), on ``nthread`` threads (the tests' one; the tool's own default is every
    hardware thread: the bench of the peer route gives it that)."""
    _, llama = needs_library()
    assert ctypes.sizeof(_Params) == 64
    llama.llama_model_quantize_default_params.restype = _Params
    llama.llama_model_quantize.restype = ctypes.c_uint32
    llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Params)]
    params = llama.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread
    params.pure = pure
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
    if kv_overrides:
        kvs = (_KvOverride * (len(kv_overrides) + 1))()
        for i, (key, tag, value) in enumerate(kv_overrides):
            kvs[i].tag, kvs[i].key = _KV_TAGS[tag], key.encode()
            if tag == "str":
                kvs[i].value.val_str = str(value).encode()
            else:
                setattr(kvs[i].value, {"int": "val_i64", "float": "val_f64", "bool": "val_bool"}[tag], value)
        keep.append(kvs)
        params.kv_overrides = ctypes.cast(kvs, ctypes.c_void_p)
    if llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")
    _keep_grids()


# --- llama.cpp's forward, watched through ``cb_eval`` (the hook llama-imatrix itself uses) ----------------------------

class _ModelParams(ctypes.Structure):
    """``llama_model_params`` of the pinned wheel (its ``_cffi_bindings.py``)."""

    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool),
                ("load_mtp", ctypes.c_bool)]


_EVAL_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class _ContextParams(ctypes.Structure):
    """``llama_context_params`` of the pinned wheel."""

    _fields_ = [*((name, ctypes.c_uint32) for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq",
                                                       "n_outputs_max", "n_outputs_max_per_seq")),
                ("n_threads", ctypes.c_int32), ("n_threads_batch", ctypes.c_int32),
                *((name, ctypes.c_int) for name in ("ctx_type", "rope_scaling_type", "pooling_type",
                                                    "attention_type", "flash_attn_type")),
                *((name, ctypes.c_float) for name in ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
                                                      "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow")),
                ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", _EVAL_CALLBACK), ("cb_eval_user_data", ctypes.c_void_p),
                ("type_k", ctypes.c_int), ("type_v", ctypes.c_int), ("moe_cache_size", ctypes.c_size_t),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                *((name, ctypes.c_bool) for name in ("embeddings", "offload_kqv", "no_perf", "op_offload",
                                                     "swa_full", "kv_unified")),
                ("samplers", ctypes.c_void_p), ("n_samplers", ctypes.c_size_t), ("ctx_other", ctypes.c_void_p)]


class _Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.c_void_p), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))), ("logits", ctypes.POINTER(ctypes.c_int8))]


_MAX_DIMS, _MAX_OP_PARAMS, _MAX_SRC, _MAX_NAME = 4, 64, 10, 64
_MAX_SEQUENCES = 64  # a batch's sequences in imatrix_of_forward (llama.cpp's own limit, LLAMA_MAX_SEQ, is higher)
_F32, _I32 = 0, 26  # enum ggml_type


class _Tensor(ctypes.Structure):
    """The head of ``struct ggml_tensor`` (ggml.h; :func:`_tensor_layout_holds` checks it against the library)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * _MAX_DIMS),
                ("nb", ctypes.c_size_t * _MAX_DIMS), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * _MAX_SRC), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * _MAX_NAME)]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _tensor_layout_holds(base: ctypes.CDLL) -> bool:
    """Whether :class:`_Tensor`'s offsets are this library's: a MUL_MAT built by ggml, its sources, data and name
    read through the struct equal what ggml's own accessors answer."""
    base.ggml_init.restype = ctypes.c_void_p
    base.ggml_init.argtypes = [_InitParams]
    base.ggml_new_tensor_2d.restype = ctypes.c_void_p
    base.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_3d.restype = ctypes.c_void_p
    base.ggml_new_tensor_3d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64]
    base.ggml_mul_mat.restype = ctypes.c_void_p
    base.ggml_mul_mat.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_mul_mat_id.restype = ctypes.c_void_p
    base.ggml_mul_mat_id.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    for name in ("ggml_get_name", "ggml_get_data", "ggml_op_desc"):
        getattr(base, name).restype = ctypes.c_void_p
        getattr(base, name).argtypes = [ctypes.c_void_p]
    base.ggml_free.argtypes = [ctypes.c_void_p]
    ctx = base.ggml_init(_InitParams(1 << 20, None, False))
    try:
        a = base.ggml_new_tensor_2d(ctx, 0, 32, 3)
        b = base.ggml_new_tensor_2d(ctx, 0, 32, 5)
        product = base.ggml_mul_mat(ctx, a, b)
        seen = _Tensor.from_address(product)
        head = _Tensor.from_address(b)
        # A MUL_MAT_ID: 3 experts of [32, 4], 2 used by each of 5 tokens; its ids (I32) the third source.
        experts = base.ggml_new_tensor_3d(ctx, 0, 32, 4, 3)
        routed = base.ggml_new_tensor_3d(ctx, 0, 32, 2, 5)
        ids = base.ggml_new_tensor_2d(ctx, _I32, 2, 5)
        indirect = _Tensor.from_address(base.ggml_mul_mat_id(ctx, experts, routed, ids))
        return (seen.src[0] == a and seen.src[1] == b and tuple(head.ne) == (32, 5, 1, 1) and head.nb[1] == 128
                and head.type == 0 and head.data == base.ggml_get_data(b)
                and ctypes.addressof(head) + _Tensor.name.offset == base.ggml_get_name(b)
                and ctypes.string_at(base.ggml_op_desc(product)) == b"MUL_MAT"
                and tuple(indirect.src[:3]) == (experts, routed, ids)
                and ctypes.string_at(base.ggml_op_desc(ctypes.addressof(indirect))) == b"MUL_MAT_ID"
                and _Tensor.from_address(ids).type == _I32 and tuple(_Tensor.from_address(ids).nb[:2]) == (4, 8))
    finally:
        base.ggml_free(ctx)


def _declare_model(llama: ctypes.CDLL) -> None:
    """The backend started and the signatures of a model's load, its vocabulary and its freeing declared."""
    llama.llama_backend_init()
    llama.llama_model_default_params.restype = _ModelParams
    llama.llama_model_load_from_file.restype = ctypes.c_void_p
    llama.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _ModelParams]
    llama.llama_model_get_vocab.restype = ctypes.c_void_p
    llama.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
    llama.llama_model_free.argtypes = [ctypes.c_void_p]


def declare_forward(llama: ctypes.CDLL) -> None:
    """The backend started and the signatures of the library's calls a forward pass makes declared: a model loaded,
    its vocabulary's size, a context, batches decoded, their logits, the KV memory cleared, all freed."""
    _declare_model(llama)
    llama.llama_context_default_params.restype = _ContextParams
    llama.llama_vocab_n_tokens.restype = ctypes.c_int32
    llama.llama_vocab_n_tokens.argtypes = [ctypes.c_void_p]
    llama.llama_init_from_model.restype = ctypes.c_void_p
    llama.llama_init_from_model.argtypes = [ctypes.c_void_p, _ContextParams]
    llama.llama_batch_init.restype = _Batch
    llama.llama_batch_init.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    llama.llama_batch_free.argtypes = [_Batch]
    llama.llama_decode.restype = ctypes.c_int32
    llama.llama_decode.argtypes = [ctypes.c_void_p, _Batch]
    llama.llama_get_logits.restype = ctypes.POINTER(ctypes.c_float)
    llama.llama_get_logits.argtypes = [ctypes.c_void_p]
    llama.llama_get_memory.restype = ctypes.c_void_p
    llama.llama_get_memory.argtypes = [ctypes.c_void_p]
    llama.llama_memory_clear.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    llama.llama_free.argtypes = [ctypes.c_void_p]


def imatrix_of_forward(model: Path, texts: list[list[int]], *, min_batch: int = 16, n_threads: int = 1,
                       batch_tokens: int = 0,
                       spent: list[float] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What llama-imatrix accumulates over ``texts`` (token ids, one sequence each, decoded alone or together as
    ``batch_tokens`` says, with every position's logits asked, as llama-imatrix asks them) when llama.cpp runs the
    GGUF ``model``: per weight, the float32 sums of each input column's squares, [n_mat, n_in], and the rows
    counted into each matrix, int64 [n_mat]. Collected in ``cb_eval`` (``llama_context_params``), the scheduler
    hook llama-imatrix itself registers, under its rules (``tools/imatrix/imatrix.cpp``, ``collect_imatrix``):

    - a MUL_MAT whose weight is named ``blk.…`` (n_mat 1): every row of its input, when the input is F32 and the
      batch holds at least ``min_batch`` tokens;
    - every MUL_MAT_ID (a mixture's experts, stacked [n_in, n_out, n_expert]: n_mat = n_expert), whatever its name
      or batch: for each token and each expert its ids tensor chose for it, the token's input to that expert (one
      row shared by every choice for gate/up, one row per choice for down) added to that expert's row, and one to
      its count. Expert by expert, then choice by choice, then token by token, as llama-imatrix sums them.

    The forward runs on ``n_threads`` threads (the tests' one; llama-imatrix's default is every hardware thread, as
    ``bench/bench_kquant_route.py`` runs it). ``batch_tokens`` 0 decodes each text alone; else consecutive texts
    of at most that many tokens in all (and at most 64) are decoded together, each its own sequence of one batch,
    as llama-imatrix decodes ``n_batch / n_ctx`` chunks at once (its default ``n_batch``: 2048): the model is read
    once a batch instead of once a text, and the rows reach the callback in the same order (text after text), so
    the sums are those of one text at a time up to the products' float32 rounding in a wider batch. A batch is one
    ubatch (llama-imatrix's ``-ub`` equal to ``-b``), so no part of it falls under ``min_batch`` alone. ``spent``,
    where given, gets the wall seconds the collector's own Python took (the callback's body, which llama-imatrix
    runs as C++), appended once at the end."""
    base, llama = needs_library()
    if not _tensor_layout_holds(base):
        pytest.skip("struct ggml_tensor of this llama.cpp build differs from the one the oracle reads")
    declare_forward(llama)
    base.ggml_op_desc.restype = ctypes.c_char_p
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}

    def floats(at: int, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(at)).copy()

    def wanted(t: _Tensor) -> bool:
        op = base.ggml_op_desc(ctypes.addressof(t))
        if op == b"MUL_MAT_ID":  # llama-imatrix asks for every one
            return True
        if op != b"MUL_MAT":
            return False
        src1 = _Tensor.from_address(t.src[1])
        return (_weight_name(_Tensor.from_address(t.src[0])).startswith("blk.") and src1.type == _F32
                and src1.ne[1] >= min_batch)

    def dense(name: str, src0: _Tensor, src1: _Tensor) -> None:
        assert src0.ne[2] * src0.ne[3] == 1, name  # the blocks' matrices: no batched weights here
        n_in = int(src1.ne[0])
        total = sums.setdefault(name, np.zeros((1, n_in), dtype=np.float32))
        rows = 0
        for i3 in range(src1.ne[3]):
            for i2 in range(src1.ne[2]):
                for row in range(src1.ne[1]):  # float32, row after row, as llama-imatrix's running sums
                    x = floats(src1.data + row * src1.nb[1] + i2 * src1.nb[2] + i3 * src1.nb[3], n_in)
                    total[0] += x * x
                    rows += 1
        counts[name] = counts.get(name, np.zeros(1, dtype=np.int64)) + rows

    def routed(name: str, src0: _Tensor, src1: _Tensor, ids: _Tensor) -> None:
        n_expert, n_in, n_chosen, n_tokens = int(src0.ne[2]), int(src1.ne[0]), int(ids.ne[0]), int(ids.ne[1])
        assert ids.type == _I32 and ids.ne[1] == src1.ne[2] and src1.ne[3] == 1, name
        chosen = [[ctypes.c_int32.from_address(ids.data + token * ids.nb[1] + k * ids.nb[0]).value
                   for k in range(n_chosen)] for token in range(n_tokens)]
        total = sums.setdefault(name, np.zeros((n_expert, n_in), dtype=np.float32))
        count = counts.setdefault(name, np.zeros(n_expert, dtype=np.int64))
        for expert in range(n_expert):
            for k in range(n_chosen):
                for token in range(n_tokens):
                    assert 0 <= chosen[token][k] < n_expert, name
                    if chosen[token][k] != expert:
                        continue
                    # gate/up read one row per token (ne[1] 1), down one per choice
                    x = floats(src1.data + (k % src1.ne[1]) * src1.nb[1] + token * src1.nb[2], n_in)
                    total[expert] += x * x
                    count[expert] += 1

    in_callback = [0.0]

    def observe(address: int, ask: bool, user: int) -> bool:
        started = time.perf_counter()
        try:
            return collect(address, ask, user)
        finally:
            in_callback[0] += time.perf_counter() - started

    def collect(address: int, ask: bool, _: int) -> bool:
        t = _Tensor.from_address(address)
        if ask:  # asked whether to be shown it
            return wanted(t)
        if not wanted(t):  # shown one not asked for: False would stop the forward
            return True
        src0, src1 = _Tensor.from_address(t.src[0]), _Tensor.from_address(t.src[1])
        assert src1.type == _F32 and src1.nb[0] == 4, _weight_name(src0)
        if base.ggml_op_desc(address) == b"MUL_MAT_ID":
            routed(_weight_name(src0), src0, src1, _Tensor.from_address(t.src[2]))
        else:
            dense(_weight_name(src0), src0, src1)
        return True

    callback = _EVAL_CALLBACK(observe)
    model_params = llama.llama_model_default_params()
    model_params.n_gpu_layers = 0
    loaded = llama.llama_model_load_from_file(str(model).encode(), model_params)
    if not loaded:
        raise RuntimeError(f"llama.cpp could not load {model}")
    groups: list[list[list[int]]] = []  # the texts decoded together, each its own sequence
    for ids in texts:
        if (groups and batch_tokens and len(groups[-1]) < _MAX_SEQUENCES
                and sum(map(len, groups[-1])) + len(ids) <= batch_tokens):
            groups[-1].append(ids)
        else:
            groups.append([ids])
    widest = max(sum(map(len, group)) for group in groups)
    params = llama.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max(widest, 32)  # a decode is one ubatch: one graph
    params.n_seq_max = max(map(len, groups))
    params.kv_unified = True  # the sequences share the n_ctx cells, as llama-imatrix's parallel chunks do
    params.n_threads = params.n_threads_batch = n_threads
    params.cb_eval = callback
    # An F32 cache and no flash attention (its CPU kernel rounds through F16): llama.cpp's attention in float32.
    params.type_k = params.type_v = 0
    params.flash_attn_type = 0
    params.no_perf = True
    ctx = llama.llama_init_from_model(loaded, params)
    batch = llama.llama_batch_init(widest, 0, 1)
    try:
        assert ctx, "llama_init_from_model failed"
        for group in groups:
            llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
            at = 0
            for sequence, ids in enumerate(group):  # text after text: the rows in the order of one at a time
                for i, token in enumerate(ids):
                    batch.token[at], batch.pos[at], batch.n_seq_id[at], batch.logits[at] = token, i, 1, 1
                    batch.seq_id[at][0] = sequence
                    at += 1
            batch.n_tokens = at
            assert llama.llama_decode(ctx, batch) == 0
    finally:
        llama.llama_batch_free(batch)
        if ctx:
            llama.llama_free(ctx)
        llama.llama_model_free(loaded)
    if spent is not None:
        spent.append(in_callback[0])
    return {name: (sums[name], counts[name]) for name in sums}


def tokenize(model: Path, lines: list[str]) -> list[list[int]]:
    """Each of ``lines`` as llama.cpp's own tokenizer splits it with the vocabulary of the GGUF ``model``
    (``llama_tokenize``, special tokens added as the vocabulary asks and not parsed in the text: what
    llama-imatrix's ``common_tokenize(ctx, prompt, true)`` does to its text file)."""
    _, llama = needs_library()
    _declare_model(llama)
    llama.llama_tokenize.restype = ctypes.c_int32
    llama.llama_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                     ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
    params = llama.llama_model_default_params()
    params.vocab_only = True
    loaded = llama.llama_model_load_from_file(str(model).encode(), params)
    if not loaded:
        raise RuntimeError(f"llama.cpp could not load {model}'s vocabulary")
    try:
        vocab = llama.llama_model_get_vocab(loaded)
        found = []
        for line in lines:
            text = line.encode()
            room = len(text) + 8  # at most a token a byte, and the special tokens
            ids = (ctypes.c_int32 * room)()
            n = llama.llama_tokenize(vocab, text, len(text), ids, room, True, False)
            assert 0 <= n <= room, (line, n)
            found.append(list(ids[:n]))
    finally:
        llama.llama_model_free(loaded)
    return found


def _weight_name(t: _Tensor) -> str:
    """``t``'s name without the backend's prefix and suffix (``CPU#blk.0.attn_k.weight#0``), as llama-imatrix
    strips them."""
    name = t.name.decode()
    return name.split("#")[1] if "#" in name else name


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class Stored(NamedTuple):
    """A tensor as a GGUF stores it: its type's name, its bytes, its ``ne`` (ggml's order: a row's length first)."""

    kind: str
    data: bytes
    ne: tuple[int, ...]


def tensors_of(path: Path, wanted: Callable[[str], bool] | None = None) -> dict[str, Stored]:
    """Every tensor of the GGUF at ``path`` read through llama.cpp's own GGUF parser (``gguf_init_from_file``,
    header only), by name in the file's order (only those whose name ``wanted`` takes, where given: a test that
    reads a layer's tensors copies no 320 MiB vocabulary table). gguf-py's reader turns every element of a
    vocabulary into a slice of its own (Gemma-3's 262,144 tokens: ~8 CPU s a file); this one, in C, takes a fraction
    of a second and reads the file as the llama.cpp that will run it does."""
    base, _ = needs_library()
    base.gguf_init_from_file.restype = ctypes.c_void_p
    base.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    for name, restype in (("gguf_get_n_tensors", ctypes.c_int64), ("gguf_get_data_offset", ctypes.c_size_t)):
        getattr(base, name).restype = restype
        getattr(base, name).argtypes = [ctypes.c_void_p]
    for name, restype in (("gguf_get_tensor_name", ctypes.c_char_p), ("gguf_get_tensor_type", ctypes.c_int),
                          ("gguf_get_tensor_offset", ctypes.c_size_t), ("gguf_get_tensor_size", ctypes.c_size_t),
                          ("gguf_get_tensor_ne", ctypes.POINTER(ctypes.c_int64))):
        getattr(base, name).restype = restype
        getattr(base, name).argtypes = [ctypes.c_void_p, ctypes.c_int64]
    base.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = base.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
    if not ctx:
        raise RuntimeError(f"llama.cpp's GGUF parser refused {path}")
    try:
        data = base.gguf_get_data_offset(ctx)
        spans = [(base.gguf_get_tensor_name(ctx, i).decode(), base.gguf_get_tensor_type(ctx, i),
                  data + base.gguf_get_tensor_offset(ctx, i), base.gguf_get_tensor_size(ctx, i),
                  tuple(base.gguf_get_tensor_ne(ctx, i)[:_MAX_DIMS]))
                 for i in range(base.gguf_get_n_tensors(ctx))]
    finally:
        base.gguf_free(ctx)
    stored = np.memmap(path, dtype=np.uint8, mode="r")
    return {name: Stored(gguf.GGMLQuantizationType(kind).name, stored[at:at + size].tobytes(), ne)
            for name, kind, at, size, ne in spans if wanted is None or wanted(name)}


# --- llama.cpp's per-tensor type choice without a model file (``src/llama-ext.h``, C++ names) ------------------------

class _QuantModelDesc(ctypes.Structure):
    """``llama_quant_model_desc``: an architecture and the hyperparameters the type rules read."""

    _fields_ = [("architecture", ctypes.c_char_p), *((name, ctypes.c_uint32) for name in (
        "n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "n_expert", "n_embd_head_k", "n_embd_head_v"))]


def quant_types(arch: str, hparams: tuple[int, ...], tensors: list[tuple[str, tuple[int, ...]]],
                ftype: int) -> list[int]:
    """The ggml type llama-quantize gives each of ``tensors`` (name, ``ne``: a row's length first; in llama.cpp's
    order: blocks by layer) in an ``ftype`` file of a model of ``arch`` with ``hparams`` (n_embd, n_ff, n_layer,
    n_head, n_head_kv, n_expert, head dim), without an importance matrix (``llama_quant_compute_types`` on
    ``llama_quant_model_from_metadata``'s mock model: llama.cpp's own rules, fallbacks included)."""
    base, llama = needs_library()
    mangled = {"model": "_Z31llama_quant_model_from_metadataPK22llama_quant_model_desc",
               "init": "_Z16llama_quant_initPK11llama_modelPK27llama_model_quantize_params",
               "types": "_Z25llama_quant_compute_typesP19quantize_state_impl11llama_ftypePP11ggml_tensorP9ggml_typem",
               "free": "_Z16llama_quant_freeP19quantize_state_impl"}
    fn = {key: getattr(llama, name) for key, name in mangled.items()}
    fn["model"].restype, fn["model"].argtypes = ctypes.c_void_p, [ctypes.POINTER(_QuantModelDesc)]
    fn["init"].restype, fn["init"].argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(_Params)]
    fn["types"].restype = None
    fn["types"].argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_int), ctypes.c_size_t]
    fn["free"].argtypes = [ctypes.c_void_p]
    llama.llama_model_quantize_default_params.restype = _Params
    llama.llama_model_free.argtypes = [ctypes.c_void_p]
    base.ggml_init.restype, base.ggml_init.argtypes = ctypes.c_void_p, [_InitParams]
    base.ggml_new_tensor.restype = ctypes.c_void_p
    base.ggml_new_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    base.ggml_set_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_set_name.restype = ctypes.c_void_p
    base.ggml_free.argtypes = [ctypes.c_void_p]
    llama.llama_backend_init()
    desc = _QuantModelDesc(arch.encode(), *hparams, hparams[-1])
    model = fn["model"](ctypes.byref(desc))
    params = llama.llama_model_quantize_default_params()
    state = fn["init"](model, ctypes.byref(params))
    ctx = base.ggml_init(_InitParams(1 << 24, None, True))  # no data: names and shapes only
    try:
        made = []
        for name, ne in tensors:
            t = base.ggml_new_tensor(ctx, 1, len(ne), (ctypes.c_int64 * len(ne))(*ne))  # F16
            base.ggml_set_name(t, name.encode())
            made.append(t)
        out = (ctypes.c_int * len(made))()
        fn["types"](state, ftype, (ctypes.c_void_p * len(made))(*made), out, len(made))
        return list(out)
    finally:
        base.ggml_free(ctx)
        fn["free"](state)
        llama.llama_model_free(model)
