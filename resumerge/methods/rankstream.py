"""A rank window over a tensor that arrives in chunks: :func:`~resumerge.methods.ranking.rank_window`, streamed.

The window of a rank-based sparsifier is defined over the whole tensor, never per chunk, so a tensor too large to
hold is ranked in passes over its chunks (in index order), with memory independent of its size:

1. a histogram of the keys' high 15 bits. For keys whose low 16 bits are known to be zero (magnitudes of bfloat16,
   see :func:`~resumerge.methods.ranking.exact_key_shift`) a bucket is one key value, and the counts alone give the
   window's bound keys and how many keys lie on either side of them;
2. otherwise (float32 and float16 keys), a histogram of the low 16 bits of the keys in the one or two buckets that
   hold the window's ends, which makes them exact as well. The first chunk's histogram predicts those buckets, so
   the first pass already counts the low bits of the keys within ``_GUESS`` buckets of each prediction; where the
   whole tensor's ends fall inside (the weights of a tensor are alike from row to row, so nearly always), no
   second pass over the chunks is needed;
3. the mask of each chunk: keys strictly inside the bounds are kept, and within a run of keys equal to a bound that
   straddles the window's end, a running count of that key's occurrences across chunks keeps exactly the indices
   a stable sort puts inside — the choice ``rank_window`` makes on the whole tensor, so the masks agree bit for bit
   whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from resumerge.methods.ranking import key_range_mask
from resumerge.torch_import import torch

# Buckets of the first pass over float32 keys: the top bits above these (the sign bit is always 0: 2¹⁵ buckets).
_COARSE_SHIFT = 16
_FINE_MASK = (1 << _COARSE_SHIFT) - 1
# Buckets either side of a predicted end whose low bits the first pass counts (5 of bfloat16 precision each: about
# 1 % of a tensor's magnitudes).
_GUESS = 2
_KEY_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class _Bound:
    """A bound of the window: its key, and how many keys of the tensor sort below and above it."""

    key: int
    less: int
    greater: int


@dataclass(frozen=True)
class _Cut:
    """A run of keys equal to ``key`` straddling an end of the window: its occurrences ``[keep_from,
    keep_to)``, counted in index order over the whole tensor, are inside."""

    key: int
    keep_from: int
    keep_to: int


class StreamedWindow:
    """Positions ``[start, stop)`` of a stable sort of ``total`` int32 keys (descending with ``descending``),
    learnt from the keys in chunks and returned as a mask per chunk.

    Use: for ``k = 0, 1, ...`` while :meth:`wants` ``(k)``, pass every chunk's keys, in index order, to
    :meth:`observe`; then pass them again, in index order, to :meth:`mask` (again after :meth:`rewind`). The chunks
    of different passes may be cut differently. Keys must be non-negative
    (:func:`~resumerge.methods.ranking.magnitude_keys` of magnitudes); with ``shift`` (at least 13) they must have
    that many low bits zero, and one pass is enough. ``start``/``stop`` are clamped to ``[0, total]``. A
    ``deferred`` window learns them from its first pass: :meth:`retarget` sets them after it, and until then
    ``start``/``stop`` are a forecast that only steers which buckets the first pass counts the low bits of (a wrong
    one costs the second pass, never a wrong mask). """

    def __init__(self, total: int, start: int, stop: int, *, descending: bool, shift: int | None = None,
                 deferred: bool = False) -> None:
        self.total, self.descending = total, descending
        self.start, self.stop = max(0, start), min(total, stop)
        self._deferred = deferred
        self._shift = _COARSE_SHIFT if shift is None else shift
        self._exact = shift is not None
        self._counts: np.ndarray | None = None
        self._guesses: list[tuple[int, np.ndarray]] | None = None  # (first bucket, low-bit counts of its run)
        self._fine: dict[int, np.ndarray] = {}  # the low-bit counts of each bucket holding an end, once known
        self._pending: dict[int, np.ndarray] = {}  # those the first pass did not guess, counted by the second
        self._ready = False
        self._bounds: tuple[_Bound | None, _Bound | None] | None = None
        self._cuts: tuple[_Cut, ...] = ()
        self._seen: dict[int, int] = {}
        self._masked = 0
        self._asked = -1

    @property
    def trivial(self) -> bool:
        """True when the window is empty or everything: its mask needs no statistics (never while deferred)."""
        if self._deferred:
            return False
        return self.start >= self.stop or (self.start == 0 and self.stop == self.total)

    def retarget(self, start: int, stop: int) -> None:
        """Set a deferred window's positions, after statistics pass 0 and before :meth:`wants` ``(1)``."""
        if not self._deferred or self._asked != 0:
            raise ValueError("only a deferred window is retargeted, once, after statistics pass 0")
        self.start, self.stop = max(0, start), min(self.total, stop)
        self._deferred = False

    def wants(self, pass_index: int) -> bool:
        """Whether statistics pass ``pass_index`` must run (ask for 0, 1, ... in order, after each pass)."""
        if pass_index != self._asked + 1:
            raise ValueError(f"passes are asked once each, in order: {pass_index} after {self._asked}")
        self._asked = pass_index
        if pass_index == 0:
            self._ready = self.trivial
            return not self._ready
        if self._deferred:
            raise ValueError("a deferred window is retargeted before statistics pass 1")
        if self.trivial or pass_index > 1:
            self._ready = True
            return False
        if not self._exact:
            self._fine = {b: found for b in self._buckets() if (found := self._guessed(b)) is not None}
            self._pending = {b: np.zeros(1 << _COARSE_SHIFT, dtype=np.int64) for b in self._buckets()
                             if b not in self._fine}
        self._ready = not self._pending
        return not self._ready

    def observe(self, pass_index: int, keys: torch.Tensor) -> None:
        """Count one chunk's keys in statistics pass ``pass_index``."""
        flat = keys.reshape(-1)
        if pass_index == 0:
            high = flat >> self._shift
            found = _histogram(high, 1 << (31 - self._shift))
            if self._counts is None:
                self._counts = found.copy()
                if not self._exact:
                    self._guesses = self._guess(found, flat.numel())
            else:
                self._counts += found
            for first, counts in self._guesses or ():
                _count_low_bits(flat, high, first, counts)
            return
        if pass_index != 1 or not self._pending:
            raise ValueError(f"statistics pass {pass_index} was not asked for")
        high = flat >> _COARSE_SHIFT
        for bucket, counts in self._pending.items():
            _count_low_bits(flat, high, bucket, counts)
        self._fine.update(self._pending)

    def mask(self, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The window's mask (bool, or 1/0 of ``dtype``) over the next chunk's keys, in index order."""
        flat = keys.reshape(-1)
        bounds = None if self.trivial else self._resolved()
        if self._masked + flat.numel() > self.total:
            raise ValueError(f"masks asked for {self._masked + flat.numel()} keys of {self.total}")
        self._masked += flat.numel()
        if bounds is None:
            fill = torch.zeros if self.start >= self.stop else torch.ones
            return fill(keys.shape, dtype=dtype, device=keys.device)
        lower, upper = bounds
        if flat.device.type == "cpu":
            # An open end is the end of the keys' range (they are non-negative int32).
            mask = _between(flat, lower.key if lower else 0, upper.key if upper else _KEY_MAX, dtype)
        else:
            mask = key_range_mask(flat, lower.key if lower else None, upper.key if upper else None, dtype)
        for cut in self._cuts:
            run = _positions_of(flat, cut.key)
            seen = self._seen.get(cut.key, 0)
            self._seen[cut.key] = seen + run.numel()
            # The run's occurrences in this chunk are numbers seen, seen + 1, ... of the whole tensor.
            mask[run[: max(0, cut.keep_from - seen)]] = 0
            mask[run[max(0, cut.keep_to - seen):]] = 0
        return mask.reshape(keys.shape)

    def rewind(self) -> None:
        """Start :meth:`mask` over again from the first chunk (a second pass that needs the masks: a rescale's
        norms, then the output)."""
        self._masked = 0
        self._seen.clear()

    # -- statistics ----------------------------------------------------------------------------------------------

    def _positions(self) -> tuple[int | None, int | None]:
        """Ascending positions of the window's lowest and highest keys; None for an end at the edge of the
        order, which needs no bound."""
        n = self.total
        low_at, high_at = (n - self.stop, n - 1 - self.start) if self.descending else (self.start, self.stop - 1)
        return (low_at if low_at > 0 else None), (high_at if high_at < n - 1 else None)

    def _buckets(self, counts: np.ndarray | None = None, scale: float = 1.0) -> list[int]:
        """The buckets holding the window's ends (of ``counts``, a histogram of ``scale`` times as many keys)."""
        counts = self._counts if counts is None else counts
        assert counts is not None
        cumulative = np.cumsum(counts)
        ends = (p * scale for p in self._positions() if p is not None)
        return sorted({min(len(cumulative) - 1, int(np.searchsorted(cumulative, p, side="right"))) for p in ends})

    def _guess(self, first: np.ndarray, keys: int) -> list[tuple[int, np.ndarray]]:
        """Runs of buckets around the ends the first chunk (``first``, a histogram of ``keys`` keys) predicts."""
        runs: list[tuple[int, int]] = []
        for bucket in self._buckets(first, keys / self.total):
            low, high = max(0, bucket - _GUESS), min(len(first) - 1, bucket + _GUESS)
            if runs and low <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], high)
            else:
                runs.append((low, high))
        return [(low, np.zeros((high - low + 1) << _COARSE_SHIFT, dtype=np.int64)) for low, high in runs]

    def _guessed(self, bucket: int) -> np.ndarray | None:
        """The first pass's low-bit counts of ``bucket``, when it guessed it."""
        for first, counts in self._guesses or ():
            if first <= bucket < first + (len(counts) >> _COARSE_SHIFT):
                return counts[(bucket - first) << _COARSE_SHIFT : (bucket - first + 1) << _COARSE_SHIFT]
        return None

    def _resolved(self) -> tuple[_Bound | None, _Bound | None]:
        if self._bounds is None:
            if self._counts is None or not self._ready:
                raise ValueError("the window's statistics passes have not all run")
            bounds = tuple(None if p is None else self._bound(p) for p in self._positions())
            self._bounds = (bounds[0], bounds[1])
            self._cuts = self._straddling()
        return self._bounds

    def _bound(self, position: int) -> _Bound:
        assert self._counts is not None
        cumulative = np.cumsum(self._counts)
        bucket = int(np.searchsorted(cumulative, position, side="right"))
        below = int(cumulative[bucket - 1]) if bucket else 0
        if self._exact:
            return _Bound(bucket << self._shift, below, self.total - int(cumulative[bucket]))
        fine = np.cumsum(self._fine[bucket])
        low = int(np.searchsorted(fine, position - below, side="right"))
        less = below + (int(fine[low - 1]) if low else 0)
        return _Bound((bucket << _COARSE_SHIFT) | low, less, self.total - below - int(fine[low]))

    def _straddling(self) -> tuple[_Cut, ...]:
        # As in rank_window: the j-th occurrence (index order) of a bound's key holds sort position ahead + j,
        # where ahead counts the keys sorting before the run in the window's direction.
        assert self._bounds is not None
        cuts = {}
        for bound in (b for b in self._bounds if b is not None):
            ahead = bound.greater if self.descending else bound.less
            run = self.total - bound.less - bound.greater
            keep_from, keep_to = max(0, self.start - ahead), max(0, self.stop - ahead)
            if keep_from > 0 or keep_to < run:
                cuts[bound.key] = _Cut(bound.key, keep_from, keep_to)
        return tuple(cuts.values())


def _between(flat: torch.Tensor, lower: int, upper: int, dtype: torch.dtype) -> torch.Tensor:
    """``lower <= flat <= upper`` for a chunk of int32 CPU keys, as a mask of ``dtype``."""
    # One unsigned comparison (keys below `lower` wrap round to large values) in numpy: five times as fast as
    # torch's two comparisons and logical and, and twice as fast as one torch comparison written into a float
    # mask (an open end is the end of the keys' range).
    keys = flat.numpy()
    inside = (keys - np.int32(lower)).view(np.uint32) <= upper - lower
    if dtype == torch.bool:
        return torch.from_numpy(inside)
    if dtype == torch.float32:
        return torch.from_numpy(inside.astype(np.float32))
    return torch.from_numpy(inside).to(dtype)


def _positions_of(flat: torch.Tensor, key: int) -> torch.Tensor:
    """The indices (int64, ascending) where ``flat`` holds ``key``."""
    if flat.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(flat.numpy() == key))  # numpy's is several times torch's speed
    return torch.nonzero(flat == key).reshape(-1)


def _count_low_bits(flat: torch.Tensor, high: torch.Tensor, first: int, counts: np.ndarray) -> None:
    """Add to ``counts`` the low 16 bits of the keys in ``flat`` whose high bits (``high``) fall in the run of
    buckets from ``first`` (``len(counts) >> 16`` of them); counts of later buckets follow at 2¹⁶ each."""
    span = len(counts) >> _COARSE_SHIFT
    if flat.device.type == "cpu":
        # One unsigned comparison selects the run (keys below it wrap around to large values); numpy's is three
        # times as fast as torch's two comparisons and boolean index.
        keys = flat.numpy()
        selected = keys[(high.numpy() - np.int32(first)).view(np.uint32) < span]
    else:
        selected = flat[(high >= first) & (high < first + span)].cpu().numpy()
    if selected.size:
        np.add.at(counts, selected - np.int32(first << _COARSE_SHIFT), 1)


def _histogram(values: torch.Tensor, size: int) -> np.ndarray:
    """Counts (int64) of each value in ``[0, max(size, largest value + 1))`` among ``values`` (non-negative
    integers)."""
    # torch's bincount takes int32 as it is, where numpy's first copies it to int64: twice as fast on a chunk.
    return torch.bincount(values, minlength=size).cpu().numpy()
