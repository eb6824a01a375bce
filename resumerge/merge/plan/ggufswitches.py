"""llama-quantize's switches that change a GGUF output's key-values, and its pairs from a file:

- ``--gguf-override-kv KEY=TYPE:VALUE`` (llama-quantize's ``--override-kv``; TYPE ``int``, ``float``, ``bool`` or
  ``str``): written as ``llama_model_quantize`` writes an override: an int as a uint32, a float as a float32, a
  str of at most 127 bytes; a key the file already has is removed and the override appended, in the order given
  (``gguf_set_val_*``).
- The ``quantize.imatrix.*`` keys llama-quantize adds (as overrides, after the user's) when given an importance
  matrix: ``file`` (the matrix's base name: resumerge never records a machine path; llama-quantize writes the
  path as typed), ``dataset`` (its first dataset, a base name too), ``entries_count`` and ``chunks_count`` (where
  the matrix counts its chunks).
- ``--gguf-tensor-type-file FILE`` (llama-quantize's ``--tensor-type-file``): ``PATTERN=TYPE`` pairs separated by
  white space, one a line as a rule.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from resumerge.outputs.gguf.layout import BOOL, F32, STRING, U32, Value

# llama_model_kv_override's key and string value: char[128], NUL-terminated
_MAX_BYTES = 127
_UINT32 = 2**32


def parse_override_kv(spec: str) -> tuple[str, Value]:
    """``--gguf-override-kv KEY=TYPE:VALUE`` as (key, the value written); raises ValueError naming ``spec``."""
    key, sep, typed = spec.partition("=")
    kind, colon, text = typed.partition(":")
    what = f"--gguf-override-kv {spec}"
    if not sep or not key or not colon or kind not in ("int", "float", "bool", "str"):
        raise ValueError(f"{what}: KEY=TYPE:VALUE with TYPE one of int, float, bool, str")
    if len(key.encode()) > _MAX_BYTES:
        raise ValueError(f"{what}: the key is longer than {_MAX_BYTES} bytes (llama.cpp's limit)")
    if key == "general.alignment":
        raise ValueError(f"{what}: resumerge lays the file out at its own alignment; general.alignment is not "
                         "overridden")
    if kind == "str":
        if len(text.encode()) > _MAX_BYTES:
            raise ValueError(f"{what}: the value is longer than {_MAX_BYTES} bytes (llama.cpp's limit)")
        return key, Value(STRING, text)
    if kind == "bool":
        if text not in ("true", "false"):
            raise ValueError(f"{what}: a bool is true or false")
        return key, Value(BOOL, text == "true")
    if kind == "int":
        if not re.fullmatch(r"\+?[0-9]+", text) or int(text) >= _UINT32:
            raise ValueError(f"{what}: an int is a whole number from 0 to {_UINT32 - 1} (llama-quantize writes "
                             "it as a uint32)")
        return key, Value(U32, int(text))
    try:
        number = float(text)
        struct.pack("<f", number)
    except (ValueError, OverflowError):
        raise ValueError(f"{what}: a float is a number within float32's range (llama-quantize writes it as a "
                         "float32)") from None
    return key, Value(F32, number)


def overridden(kv: list[tuple[str, Value]], overrides: Sequence[tuple[str, Value]]) -> list[tuple[str, Value]]:
    """``kv`` with each of ``overrides`` set as ``gguf_set_val_*`` sets it: a key already there removed, the
    override appended."""
    out = list(kv)
    for key, value in overrides:
        out = [(k, v) for k, v in out if k != key]
        out.append((key, value))
    return out


def _base_name(path: str) -> str:
    return re.split(r"[/\\]", path)[-1]


def imatrix_keys(file: str, dataset: str | None, entries: int, chunks: int) -> list[tuple[str, Value]]:
    """The ``quantize.imatrix.*`` keys llama-quantize writes for an importance matrix at ``file`` of ``entries``
    entries over ``chunks`` chunks measured on ``dataset`` (None: the matrix names none), in its order; paths as
    base names, strings cut at 127 bytes as llama.cpp cuts them."""
    def cut(text: str) -> str:
        return text.encode()[:_MAX_BYTES].decode(errors="ignore")

    keys = [("quantize.imatrix.file", Value(STRING, cut(_base_name(file))))]
    if dataset is not None:
        keys.append(("quantize.imatrix.dataset", Value(STRING, cut(_base_name(dataset)))))
    keys.append(("quantize.imatrix.entries_count", Value(U32, entries)))
    if chunks > 0:
        keys.append(("quantize.imatrix.chunks_count", Value(U32, chunks)))
    return keys


def tensor_type_file(path: Path, check: Callable[[Sequence[str]], object]) -> tuple[str, ...]:
    """The ``PATTERN=TYPE`` pairs of the ``--gguf-tensor-type-file`` at ``path``, each checked by ``check`` (a
    callable of a pair sequence raising ValueError); raises ValueError naming ``path:line`` for a bad one or
    OSError where the file cannot be read."""
    pairs: list[str] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--gguf-tensor-type-file {path}: not a text file of PATTERN=TYPE pairs") from None
    for number, line in enumerate(text.splitlines(), 1):
        for pair in line.split():
            try:
                check([pair])
            except ValueError as error:
                why = str(error).removeprefix(f"--gguf-tensor-type {pair}: ")
                raise ValueError(f"--gguf-tensor-type-file {path}:{number}: {pair}: {why}") from None
            pairs.append(pair)
    return tuple(pairs)
