"""llama.cpp's 1- and 2-bit grids kept per machine for the oracle of tests/llamacpp_oracle.py.

Before its first IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS or IQ2_S block, ``ggml_quantize_chunk`` builds the type's search tables
(``iq2xs_init_impl``: the grid, a map of every point of levels 0..3 to its grid index or its neighbours' list, and
those lists: a sort of the whole grid for each of the ~40,000 points off it). That is about 12 CPU s for the 1-bit
grid, 6 for IQ2_S's, 3 for IQ2_XS's and 1 for IQ2_XXS's, paid by every process that quantizes the type: each test
worker, each ``pytest`` run of a few tests. The tables are a function of the library's code alone (the sort's order is
total: distance, then index), so :func:`keep` copies the ones the library built, once per machine and library build
(keyed on the SHA-256 of ``libggml-base``), and :func:`restore` hands a later process's library those very tables
before it builds any: it then finds them built (``iq2_data[i].grid`` set) and skips its own set-up. Nothing of
resumerge's takes part: every byte kept was written by llama.cpp, and a kept file that does not match its digest, or
whose map does not index its own grid, is ignored (the library builds its tables again). ``restore`` places them in
the library's static ``iq2_data`` (found through the library's symbol table, its size checked: four entries of a
grid, a map and the neighbours' lists), each in memory of the C allocator, as the library's own would be.
``RESUMERGE_TEST_LLAMACPP_GRIDS=0`` turns the whole of it off (the library builds its own tables, as before).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import struct
from pathlib import Path

import numpy as np

# iq2_data's entries: (IQ2_XXS), (IQ2_XS), (IQ1_S and IQ1_M), (IQ2_S), each {uint64_t *grid; int *map; uint16_t
# *neighbours} (ggml-quants.c), with its grid's number of points; the map covers every key of levels 0..2 (43692).
_GRID_POINTS = (256, 512, 2048, 1024)
_MAP_SIZE = 43692
_SLOTS = len(_GRID_POINTS)
_FORMAT = 1
_SETTLED: set[int] = set()  # the slots this process restored or kept: never copied again


def enabled() -> bool:
    return os.environ.get("RESUMERGE_TEST_LLAMACPP_GRIDS", "1") != "0"


@functools.cache
def _folder(library_file: Path) -> Path:
    from realmodel import cached

    digest = hashlib.sha256(library_file.read_bytes()).hexdigest()[:16]
    return cached(f"llamacpp-iq2-grids-{_FORMAT}-{digest}")


def sections(data: bytes | bytearray) -> list[tuple[int, ...]]:
    """The section headers of the ELF64 little-endian file ``data`` (name, type, flags, address, offset, size,
    link, info, alignment, entry size)."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def _symbols(path: Path, names: set[str]) -> dict[str, tuple[int, int]]:
    """(value, size) of each of ``names`` in the ELF64 file ``path``'s full symbol table (``.symtab``)."""
    data = path.read_bytes()
    found: dict[str, tuple[int, int]] = {}
    headers = sections(data)
    for section in headers:
        if section[1] != 2:  # SHT_SYMTAB
            continue
        strings = headers[section[6]][4]
        for at in range(section[4], section[4] + section[5], 24):
            name_at, _, _, _, value, size = struct.unpack_from("<IBBHQQ", data, at)
            end = data.index(0, strings + name_at)
            name = data[strings + name_at:end].decode()
            if name in names:
                found[name] = (value, size)
    return found


@functools.cache
def _kept_table(library_file: Path, base: ctypes.CDLL) -> tuple[ctypes.Array[ctypes.c_void_p], Path] | None:
    """The library's table (:func:`_table`) and the machine's folder of its tables, None where neither is kept."""
    if not enabled():
        return None
    table = _table(library_file, base)
    return None if table is None else (table, _folder(library_file))


def _table(library_file: Path, base: ctypes.CDLL) -> ctypes.Array[ctypes.c_void_p] | None:
    """The library's ``iq2_data`` (12 pointers), or None where its symbols or size are not what this file reads."""
    symbols = _symbols(library_file, {"iq2_data", "ggml_quantize_init", "ggml_quantize_chunk"})
    if len(symbols) != 3 or symbols["iq2_data"][1] != _SLOTS * 3 * 8:
        return None
    loads = {ctypes.cast(getattr(base, name), ctypes.c_void_p).value - symbols[name][0]
             for name in ("ggml_quantize_init", "ggml_quantize_chunk")}
    if len(loads) != 1:
        return None
    return (ctypes.c_void_p * (_SLOTS * 3)).from_address(loads.pop() + symbols["iq2_data"][0])


def _checked(grid: np.ndarray, kmap: np.ndarray, neighbours: np.ndarray, points: int) -> bool:
    """Whether the tables are whole: the map sends each grid point's key to its index, every other key to a list of
    neighbours inside ``neighbours``."""
    if grid.size != points * 8 or kmap.size != _MAP_SIZE:
        return False
    levels = (grid.reshape(points, 8).astype(np.int64) - 1) // 2
    keys = (levels << (2 * np.arange(8))).sum(axis=1)
    off = -kmap[kmap < 0] - 1
    return bool(np.array_equal(kmap[keys], np.arange(points)) and off.size and off.max() < neighbours.size
                and np.all(neighbours[off] > 0))


def _read(table: ctypes.Array[ctypes.c_void_p], slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The tables of ``slot`` the library holds (grid bytes, map, neighbours' lists), or None before it has them."""
    grid_at, map_at, neighbours_at = table[3 * slot:3 * slot + 3]
    if not grid_at or not map_at or not neighbours_at:
        return None
    points = _GRID_POINTS[slot]
    grid = np.frombuffer(ctypes.string_at(grid_at, points * 8), dtype=np.uint8)
    kmap = np.frombuffer(ctypes.string_at(map_at, _MAP_SIZE * 4), dtype=np.int32)
    off = -kmap[kmap < 0].astype(np.int64) - 1
    heads = np.frombuffer(ctypes.string_at(neighbours_at, 2 * (int(off.max()) + 1)), dtype=np.uint16)
    length = int((off + 1 + heads[off]).max())
    return grid, kmap, np.frombuffer(ctypes.string_at(neighbours_at, 2 * length), dtype=np.uint16)


def held(library_file: Path, base: ctypes.CDLL, slot: int) -> str | None:
    """The SHA-256 of the tables of ``slot`` the library holds now (None before it has them)."""
    table = _table(library_file, base)
    found = None if table is None else _read(table, slot)
    return None if found is None else _digest(*found).hex()


def keep(library_file: Path, base: ctypes.CDLL) -> None:
    """Copy each table the library has built and the machine does not keep yet (written whole, then renamed)."""
    found_table = _kept_table(library_file, base)
    if found_table is None:
        return
    table, folder = found_table
    for slot, points in enumerate(_GRID_POINTS):
        if slot in _SETTLED or not table[3 * slot]:
            continue
        _SETTLED.add(slot)
        kept = folder / f"{slot}.npz"
        found = None if kept.is_file() else _read(table, slot)
        if found is None or not _checked(*found, points):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{slot}.{os.getpid()}.npz"
        np.savez(partial, grid=found[0], kmap=found[1], neighbours=found[2],
                 digest=np.frombuffer(_digest(*found), dtype=np.uint8))
        os.replace(partial, kept)


def _digest(*parts: np.ndarray) -> bytes:
    found = hashlib.sha256()
    for part in parts:
        found.update(part.tobytes())
    return found.digest()


def restore(library_file: Path, base: ctypes.CDLL) -> None:
    """Hand the freshly loaded library every table the machine keeps (those it has not built itself)."""
    found_table = _kept_table(library_file, base)
    if found_table is None:
        return
    table, folder = found_table
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    for slot, points in enumerate(_GRID_POINTS):
        if table[3 * slot] or not (folder / f"{slot}.npz").is_file():
            continue
        try:
            with np.load(folder / f"{slot}.npz") as kept:
                grid, kmap, neighbours = kept["grid"], kept["kmap"], kept["neighbours"]
                digest = kept["digest"].tobytes()
        except (OSError, ValueError, KeyError):
            continue
        if digest != _digest(grid, kmap, neighbours) or not _checked(grid, kmap, neighbours, points):
            continue
        pointers = []
        for part in (grid, kmap, neighbours):
            raw = np.ascontiguousarray(part).tobytes()
            at = libc.malloc(len(raw))
            ctypes.memmove(at, raw, len(raw))
            pointers.append(at)
        table[3 * slot + 1], table[3 * slot + 2], table[3 * slot] = pointers[1], pointers[2], pointers[0]
        _SETTLED.add(slot)
