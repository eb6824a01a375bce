"""A long sum in one fixed order: torch's own single-thread CPU order, fed whole or in consecutive pieces.

The L1 norms of a ``rescale`` are sums over a whole tensor, and the bits of ``torch.sum`` depend on how torch
splits it: over its threads on the CPU, over blocks on a GPU. :class:`OrderedSum` adds the same numbers in one
order fixed by the count alone, the order of torch 2.x's vectorised cascade sum on one x86 thread (32 interleaved
accumulators of four levels, each level folding a fixed number of the level below), using only elementwise
additions, which round the same way on every device. So a sum has the same bits

- fed as one tensor or as its row chunks, first to last, cut anywhere;
- for any thread count, and on a GPU as on the CPU;
- as ``torch.sum`` over the whole tensor on one thread of torch's x86 CPU kernels (their reductions use 256-bit
  vectors, even on this AVX-512 machine), which keeps rescaled results bit-identical to mergekit run on one
  thread (``tests/methods/test_summation.py`` pins it for the installed torch; where it does not hold, results
  are still the same across chunking, threads and devices, only not mergekit's).

Sums of bfloat16 and float16 accumulate in float32 and round once at the end, as torch's do; float64 in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from resumerge.machine.torch_import import torch

_ILP: Final = 4  # independent vector accumulators per level (torch's ilp_factor)
_LEVELS: Final = 4  # cascade levels (torch's num_levels)
_VECTOR_BYTES: Final = 32  # one 256-bit vector register
# Numbers an OrderedSum fed in pieces lets wait before folding them (4 MiB of float32).
_FOLD_AT: Final = 1 << 20


def _ceil_log2(value: int) -> int:
    return 0 if value <= 1 else (value - 1).bit_length()


class OrderedSum:
    """The sum of ``total`` numbers of ``dtype`` fed in order through :meth:`add`, read by :meth:`result`.

    Feeding every number exactly once, in order, in pieces of any size, gives the same bits as one :meth:`add`
    of the whole (see the module docstring for the order). Raises ``ValueError`` when more than ``total``
    numbers are fed or :meth:`result` is read before all of them were.
    """

    def __init__(self, total: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 lend: Callable[[int], torch.Tensor] | None = None) -> None:
        """``lend(count)``: where numbers fed in pieces wait to be folded, asked for (at most once, only when some
        must wait) as a 1-D tensor of ``dtype`` of at least ``count`` entries, the caller's to reuse once
        :meth:`result` is read; without it a buffer is allocated then."""
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"no ordered sum for {dtype}")
        self.total, self.dtype = total, dtype
        self.acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.lanes = _VECTOR_BYTES // self.acc_dtype.itemsize  # accumulator lanes of one vector
        # A vector load of half precision reads twice the lanes and adds its two halves (torch's cast load).
        self.per_vector = self.lanes * (2 if dtype in (torch.bfloat16, torch.float16) else 1)
        vectors = total // self.per_vector
        self._rows = vectors // _ILP  # rows of _ILP vectors folded by the cascade
        self._row_width = _ILP * self.per_vector
        self._cascade_end = self._rows * self._row_width  # numbers after it form the tails
        self._step = 1 << max(4, _ceil_log2(self._rows) // _LEVELS)
        width = _ILP * self.lanes
        self._acc = [torch.zeros(width, dtype=self.acc_dtype, device=device) for _ in range(_LEVELS)]
        self._count = [0] * _LEVELS  # values folded into each level since it last passed its sum on
        self._fed = 0
        # Numbers per block folded at once: whole groups of every level below the top.
        self._block = self._row_width * self._step ** (_LEVELS - 1)
        # Cascade numbers wait in a buffer until this many (whole blocks, a few MiB) can be folded at once, so
        # pieces as small as a row chunk cost no more than one whole add.
        self._fold_at = min(max(1, _FOLD_AT // self._block) * self._block, self._cascade_end)
        self._lend = lend
        self._buffer: torch.Tensor | None = None
        self._filled = 0
        self._tails: list[torch.Tensor] = []

    @staticmethod
    def buffer_bytes(total: int, itemsize: int) -> int:
        """At most what an ordered sum of ``total`` numbers of ``itemsize`` bytes fed in pieces keeps waiting to be
        folded."""
        return min(total, _FOLD_AT) * itemsize

    def add(self, values: torch.Tensor) -> None:
        """Feed the next ``values.numel()`` numbers (in ``values``' row-major order)."""
        flat = values.reshape(-1)
        if flat.dtype != self.dtype:
            raise ValueError(f"an ordered sum of {self.dtype} was fed {flat.dtype}")
        if self._fed + flat.numel() > self.total:
            raise ValueError(f"an ordered sum of {self.total} numbers was fed {self._fed + flat.numel()}")
        start = self._fed
        self._fed += flat.numel()
        # The part that belongs to the cascade is folded straight from the piece where it can be: its last part,
        # or whole blocks while nothing waits. Anything else waits in the buffer. Numbers past the cascade form the
        # tails, summed by result().
        cascade = max(0, min(self._fed, self._cascade_end) - start)
        head = flat[:cascade]
        while head.numel():
            if not self._filled and self._fed >= self._cascade_end:  # the last of the cascade: no copy
                self._fold_rows(head)
                break
            if not self._filled and head.numel() >= self._block:  # straight from the piece, no copy
                whole = head.numel() // self._block * self._block
                self._fold_rows(head[:whole])
                head = head[whole:]
                continue
            # Folding costs a few dozen small kernels whatever its size, so row chunks wait in a buffer for more.
            if self._buffer is None:
                self._buffer = (torch.empty(self._fold_at, dtype=self.dtype, device=self._acc[0].device)
                                if self._lend is None else self._lend(self._fold_at)[: self._fold_at])
            take = min(head.numel(), self._fold_at - self._filled)
            self._buffer[self._filled : self._filled + take].copy_(head[:take])
            self._filled += take
            head = head[take:]
            if self._filled == self._fold_at:
                self._fold_rows(self._buffer)
                self._filled = 0
        if cascade < flat.numel():
            self._tails.append(flat[cascade:].clone())  # at most a row's worth

    def result(self) -> torch.Tensor:
        """The sum, a 0-dim tensor of ``dtype`` (the pieces fed are not needed any more)."""
        return self.wide_result().to(self.dtype)

    def wide_result(self) -> torch.Tensor:
        """The sum before its rounding to ``dtype``: a 0-dim tensor of the accumulator's dtype (float32 for the
        half types), as ``torch.sum(values, dtype=torch.float32)`` gives it (what ``torch.mean`` divides)."""
        if self._fed != self.total:
            raise ValueError(f"an ordered sum of {self.total} numbers read after {self._fed}")
        if self.total < self.per_vector:
            return self._short_result()
        if self._filled and self._buffer is not None:  # whole rows short of a buffer: folded once, at the end
            self._fold_rows(self._buffer[: self._filled])
            self._filled = 0
        rows = self._acc[0]
        for level in range(1, _LEVELS):
            rows = rows + self._acc[level]
        partial = rows.view(_ILP, self.lanes)
        tails = self._take(self._tails)
        first = partial[0]
        vectors_end = (self.total // self.per_vector - self._rows * _ILP) * self.per_vector
        for offset in range(0, vectors_end, self.per_vector):  # whole vectors short of a row
            first = first + self._lanes_of(tails[offset : offset + self.per_vector].view(1, -1))[0]
        for k in range(1, _ILP):
            first = first + partial[k]
        total = torch.zeros((), dtype=self.acc_dtype, device=first.device)
        for value in tails[vectors_end:].to(self.acc_dtype):  # single numbers short of a vector
            total = total + value
        for lane in first:
            total = total + lane
        return total

    def _short_result(self) -> torch.Tensor:
        # Fewer numbers than one vector load: torch's scalar loop, four interleaved accumulators (numbers i, i+4,
        # i+8 go to accumulator i), the numbers past the last group of four added to the first, then the other
        # three added to it in turn.
        numbers = self._take(self._tails).to(self.acc_dtype)
        zero = torch.zeros((), dtype=self.acc_dtype, device=numbers.device)
        grouped = self.total // _ILP * _ILP
        partial = [zero.clone() for _ in range(_ILP)]
        for position in range(grouped):
            partial[position % _ILP] = partial[position % _ILP] + numbers[position]
        # The cascade's empty upper levels are added too: +0, which turns a -0 into +0.
        partial = [value + zero for value in partial]
        for value in numbers[grouped:]:
            partial[0] = partial[0] + value
        for value in partial[1:]:
            partial[0] = partial[0] + value
        return partial[0]

    def _take(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        joined = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]) if pieces else \
            torch.empty(0, dtype=self.dtype, device=self._acc[0].device)
        pieces.clear()
        return joined

    def _lanes_of(self, vectors: torch.Tensor) -> torch.Tensor:
        # (n, per_vector) numbers -> (n, lanes) accumulator values as one vector load gives them.
        wide = vectors.to(self.acc_dtype)
        return wide if self.per_vector == self.lanes else wide[:, : self.lanes] + wide[:, self.lanes :]

    def _fold_rows(self, numbers: torch.Tensor) -> None:
        # Whole rows into level 0, as consecutive _ILP-vector loads (torch's ILP accumulators side by side). Half
        # precision is widened a quarter at a time (whole level-0 groups), so its float32 copy stays small; folding
        # consecutive parts is folding the whole.
        part = numbers.numel()
        if self.per_vector != self.lanes:
            group = self._row_width * self._step
            part = max(group, numbers.numel() // 4 // group * group)
        for start in range(0, numbers.numel(), part):
            piece = numbers[start : start + part]
            self._fold(0, self._lanes_of(piece.view(-1, self.per_vector)).view(-1, _ILP * self.lanes))

    def _fold(self, level: int, values: torch.Tensor) -> None:
        # Fold `values` (m × width, in order) into `level`: each value is added to the level's accumulator, and
        # once it holds _step values its sum goes to the level above and it restarts from zero. The top level
        # never passes on. Runs of whole groups are folded side by side, _step additions over all groups at once.
        acc, step = self._acc, self._step
        if level == _LEVELS - 1:
            for value in values:
                acc[level] = acc[level] + value
            return
        position, count = 0, values.shape[0]
        if self._count[level]:
            take = min(step - self._count[level], count)
            for value in values[:take]:
                acc[level] = acc[level] + value
            self._count[level] += take
            position = take
            if self._count[level] == step:
                self._fold(level + 1, acc[level].view(1, -1))
                acc[level] = torch.zeros_like(acc[level])
                self._count[level] = 0
        groups = (count - position) // step
        if groups:
            block = values[position : position + groups * step].view(groups, step, -1)
            sums = block[:, 0] + 0.0  # 0 + v, as an accumulator starting from zero adds it (-0 becomes +0)
            for j in range(1, step):
                sums.add_(block[:, j])
            self._fold(level + 1, sums)
            position += groups * step
        for value in values[position:]:
            acc[level] = acc[level] + value
        self._count[level] += count - position


def ordered_sum(values: torch.Tensor) -> torch.Tensor:
    """``values.sum()`` in :class:`OrderedSum`'s order, a 0-dim tensor of ``values``' dtype."""
    summer = OrderedSum(values.numel(), values.dtype, values.device)
    summer.add(values)
    return summer.result()


def row_sum(stacked: torch.Tensor) -> torch.Tensor:
    """``stacked.sum(dim=0)`` with the same bits, faster where that is proved for the installed torch.

    torch's CPU sum over the outer dimension of two rows costs five times an elementwise add of them (measured on
    bfloat16 blocks of 64k positions: 185 µs against 35), and TIES' combine takes three such sums per block. Over
    exactly two rows on the CPU that sum is ``(+0 + a) + (+0 + b)`` accumulated in float32 for half precision and
    rounded once, which is ``a + b`` (one rounding of the float32 sum, as torch's half-precision add does) with
    ``+0`` added after (so that ``-0 + -0`` gives ``+0`` as the sum does). Only a NaN's bits can differ (torch's
    sum rounds it to a canonical NaN, its add keeps the operand's sign): where the result may hold a NaN, the sum
    is taken by torch itself. Any other count of rows, or another device, is ``torch.sum``'s
    (``tests/methods/test_summation.py`` pins the equality for the installed torch)."""
    if stacked.dim() < 1 or stacked.shape[0] != 2 or stacked.device.type != "cpu" or not stacked.is_floating_point():
        return stacked.sum(dim=0)
    found = torch.add(stacked[0], stacked[1]).add_(0.0)
    # Any NaN makes the whole sum NaN (an inf of each sign too: then the fallback is only slower); a contiguous
    # sum is a twentieth of the cost of isnan().any() on bfloat16.
    if bool(found.sum().isnan()):
        return stacked.sum(dim=0)
    return found
