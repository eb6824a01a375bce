"""The GGUF output codec: an output tensor's value (Hugging Face layout) stored as llama.cpp stores it — under its
GGUF name, with the family's transform applied (llama's q/k rows permuted per head, gemma's norms +1) and encoded
as llama.cpp's quantizer encodes it (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K ... Q6_K and
the i-quants IQ4_NL, IQ4_XS: :mod:`.encoders`), a row chunk at a time (a chunk of a permuted q/k is whole heads)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from resumerge.inputs.codecs.protocol import MAIN, OutPart, TensorEncoder
from resumerge.inputs.gguf import blocks
from resumerge.inputs.gguf.codec import GGUF_ROUND_TRIP
from resumerge.inputs.gguf.names import NORM_MINUS_ONE, gguf_rows
from resumerge.outputs.gguf import encoders

if TYPE_CHECKING:

    from resumerge.inputs.codecs.protocol import Lend
    from resumerge.machine.torch_import import torch

# ggml type id -> its name (ggml_type_name upper-cased; GGUF_ROUND_TRIP's key), for every type a GGUF output writes
TYPE_NAMES: Mapping[int, str] = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 7: "Q5_1", 6: "Q5_0", 3: "Q4_1", 2: "Q4_0",
                                 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL",
                                 23: "IQ4_XS", 18: "IQ3_XXS", 21: "IQ3_S", 16: "IQ2_XXS", 17: "IQ2_XS",
                                 22: "IQ2_S", 19: "IQ1_S", 29: "IQ1_M"}
_STORED = {0: "F32", 1: "F16", 30: "BF16"}  # the stored dtype of the plain types (the others: bytes)


@dataclass(frozen=True)
class GgufOutCodec(TensorEncoder):
    """One output tensor written to a GGUF: its GGUF name, ggml type, transform and rows per head."""

    name: ClassVar[str] = "gguf-out"

    gguf_name: str
    ggml_type: int
    transform: str = ""
    head_rows: int = 1
    # The type llama.cpp's quantizer picks for it, where resumerge writes another (-1: the same; see
    # resumerge.merge.plan.gguftypes): what the plan's notes name.
    llama_type: int = -1
    # The importance matrix file (--imatrix) whose entry for this tensor weights its encoding, as llama-quantize
    # weights it ("": none, or no entry for it); the plan checked the entry's size.
    imatrix: str = ""
    # The expert the value's first row is, for a stack of experts written whole (dim 0: experts) and encoded in
    # row chunks of experts (from_row): each expert weighted by its own slice of the entry. Not in the identity:
    # a chunk's, never the plan's.
    first_row: int = 0

    @property
    def row_block(self) -> int:
        return self.head_rows

    def identity(self) -> tuple[Any, ...]:
        # The importance matrix by its file's name, never its folder (a computed one's is in the state dir): what
        # its values are, the plan's fingerprint holds apart (the file's digest, or the texts' it is computed from).
        return tuple(Path(v).name if f == "imatrix" else v
                     for v, f in zip(super().identity(), ("name", *(f.name for f in fields(self))))
                     if f != "first_row")

    def sampled(self) -> GgufOutCodec:
        """Itself, or where its importance matrix is computed by the run and not there yet (``plan`` before the
        run), the same encoding unweighted: the quantizer's search costs the same with weights as without."""
        return replace(self, imatrix="") if self.imatrix and not Path(self.imatrix).is_file() else self

    def from_row(self, first: int) -> GgufOutCodec:
        return replace(self, first_row=self.first_row + first) if self.imatrix and first else self

    @property
    def writes_into(self) -> bool:
        return True

    @property
    def mergekit_reads(self) -> bool:
        return False

    @property
    def round_trip(self) -> tuple[str, float] | None:
        name = TYPE_NAMES[self.ggml_type]
        error = GGUF_ROUND_TRIP.get(name)
        return None if error is None else (name, error)

    def quantization_config(self, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return None

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of a value of ``shape``: a block type as rows of block bytes."""
        if self.ggml_type in _STORED:
            return shape
        values, size = blocks.BLOCK_BYTES[self.ggml_type]
        return (*shape[:-1], shape[-1] // values * size)

    def value_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        if self.ggml_type in _STORED:
            return stored
        values, size = blocks.BLOCK_BYTES[self.ggml_type]
        return (*stored[:-1], stored[-1] // size * values)

    def out_parts(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[OutPart, ...]:
        return (OutPart(MAIN, self.gguf_name, _STORED.get(self.ggml_type, "U8"), self.stored_shape(shape)),)

    @property
    def slice_index(self) -> int:
        """Which expert's slice of its GGUF tensor this output tensor is (-1: the whole tensor)."""
        return -1

    def importance(self, name: str, expert: int, columns: int) -> np.ndarray | None:
        """The quantizer's per-column weights for GGUF tensor ``name`` (expert ``expert``'s slice; -1: it has
        one), None without an importance matrix."""
        if not self.imatrix:
            return None
        from resumerge.outputs.gguf.imatrix import entry

        return entry(self.imatrix, name, expert, columns)

    def encode(self, value: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
        from resumerge.machine.torch_import import torch

        target = self._direct(value)
        if target is not None:
            out = torch.empty(value.shape, dtype=target)  # F16 and F32 store the value's shape
            self._cast_into(value, out)
            return {MAIN: out}
        stored = self._encoded(self._gguf_values(value), self.gguf_name)
        if self.ggml_type == blocks.BF16:
            stored = stored.view(torch.bfloat16)
        return {MAIN: stored.to(value.device)}

    def encode_into(self, value: torch.Tensor, dtype: str, into: Mapping[str, torch.Tensor], *,
                    lend: Lend | None = None) -> None:
        target = self._direct(value)
        if target is not None:
            self._cast_into(value, into[MAIN].view(target))
            return
        # the block bytes straight there, from float32 values in the buffer lent for them
        self._encoded(self._gguf_values(value, lend), self.gguf_name, into[MAIN])

    def _direct(self, value: torch.Tensor) -> torch.dtype | None:
        """The dtype an F32 or F16 tensor is stored in where ``value`` is cast straight to it (:meth:`_cast_into`)
        with the bytes the float32 path writes (None: it takes that path). The float32 path converted a bfloat16
        merge to a fresh float32 tensor (twice its size, in fresh pages the kernel zeroes) and that to a fresh
        float16 one: the F16 merge's largest source of page faults. Straight is the same bits where the cast to
        float32 is exact and the one rounding is the only one: bfloat16 or float32 to F16 (a float16 value takes
        the float32 path: through float32 a NaN's payload comes out quieted, copied it does not), any of the three
        to F32; never for gemma's norms (+1 in float32) or off the host."""
        from resumerge.machine.torch_import import torch

        if value.device.type != "cpu" or self.transform == NORM_MINUS_ONE:
            return None
        if self.ggml_type == blocks.F16 and value.dtype in (torch.bfloat16, torch.float32):
            return torch.float16
        if self.ggml_type == blocks.F32 and value.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return torch.float32
        return None

    def _cast_into(self, value: torch.Tensor, into: torch.Tensor) -> None:
        """``value`` cast into ``into`` (contiguous, as many elements), the q/k rows permuted on the way
        (:func:`~resumerge.inputs.gguf.names.gguf_rows`, by strides: no permuted copy between); not gemma's norms."""
        out = into.view(value.shape)
        if not self.transform:
            out.copy_(value)
            return
        n, half = value.shape[0] // self.head_rows, self.head_rows // 2
        # gguf_rows: HF row i of a head is GGUF row 2i, row i + head/2 is 2i + 1.
        out.view(n, half, 2, *value.shape[1:]).copy_(value.reshape(n, 2, half, *value.shape[1:]).transpose(1, 2))

    def _encoded(self, rows: torch.Tensor, gguf_name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` (GGUF values) of GGUF tensor ``gguf_name`` encoded (into ``into`` when given), with their
        importance weights: a stack of experts (3-D, written whole) expert by expert, each with its own slice of
        the entry (the first being expert :attr:`first_row`), as llama-quantize weights expert e by its slice e."""
        from resumerge.machine.torch_import import torch

        table = self._stacked(gguf_name, rows) if self.slice_index < 0 else None
        if table is None:
            return encoders.encode(rows, self.ggml_type, into,
                                   importance=self.importance(gguf_name, self.slice_index, rows.shape[-1]))
        done = [encoders.encode(rows[i], self.ggml_type, None if into is None else into[i],
                                importance=table[self.first_row + i]) for i in range(rows.shape[0])]
        return into if into is not None else torch.stack(done)

    def _stacked(self, gguf_name: str, rows: torch.Tensor) -> np.ndarray | None:
        """The per-expert weights [n_mat, columns] of a stack of experts' rows (3-D), None where there is one
        matrix (or no weights)."""
        if not self.imatrix or rows.dim() != 3:
            return None
        from resumerge.outputs.gguf.imatrix import entry_rows

        table = entry_rows(self.imatrix, gguf_name, rows.shape[-1])
        return table if table is not None and table.shape[0] > 1 else None

    def _gguf_values(self, value: torch.Tensor, lend: Lend | None = None) -> torch.Tensor:
        """``value`` as float32 on the host in GGUF's layout: the family's transform applied; in the buffer
        ``lend`` lends (use ``"gguf-values"``) where given and ``value`` is on the host, else fresh. The block
        types' float32 copy of every chunk was a fresh buffer twice the size of a bfloat16 merge's chunk, and a
        permuted q/k a second one; the same values either way."""
        from resumerge.machine.torch_import import torch

        if lend is not None and value.device.type == "cpu":
            out = lend("gguf-values", tuple(value.shape), torch.float32)
            if self.transform == NORM_MINUS_ONE:
                return out.copy_(value).add_(1)  # as rows + 1: the value in float32, then + 1 in float32
            self._cast_into(value.detach(), out)
            return out
        rows = value.detach().to("cpu", torch.float32)
        if self.transform == NORM_MINUS_ONE:
            return rows + 1
        if self.transform:  # HF -> GGUF
            return gguf_rows(rows, self.head_rows)
        return rows
