"""The rank window of the rank-based sparsifiers: positions ``[start, stop)`` of a stable sort of a tensor's keys,
whole or arriving in chunks — one definition, :class:`StreamedWindow`, whose whole-tensor form is the window over
one chunk.

A window is two bound keys (the keys at its ends in the sort) and, where a run of keys equal to a bound straddles
an end, which of that run's occurrences (in index order) lie inside: the lowest indices first, as a stable sort
orders them (:class:`_Cut`). Every mask is the keys between the bounds, less the cut occurrences, so the masks of
a whole tensor and of its chunks agree bit for bit whatever the chunking. Only how the bounds are learnt differs:

- **over one chunk** (``whole``) they are selected from the chunk itself by an O(n) selection
  (:func:`~resumerge.merge.methods.ranking.order_statistics`), and the counts that place a straddling run come from the
  mask's own count and one comparison: no statistics pass, and no scratch beyond the selection's copy of the keys
  and the mask, so the memory is per element (a method's footprint can declare it);
- **over several chunks** the window is ranked in passes over the chunks (in index order), with memory independent
  of the tensor's size:

  1. a histogram of the keys' high 15 bits. For keys whose low 16 bits are known to be zero (magnitudes of
     bfloat16, see :func:`~resumerge.merge.methods.ranking.exact_key_shift`) a bucket is one key value, and the counts
     alone give the window's bound keys and how many keys lie on either side of them;
  2. otherwise (float32 and float16 keys), a histogram of the low 16 bits of the keys in the one or two buckets
     that hold the window's ends, which makes them exact as well. The first chunk's histogram predicts those
     buckets, so the first pass already counts the low bits of the keys within ``_GUESS`` buckets of each
     prediction; where the whole tensor's ends fall inside (the weights of a tensor are alike from row to row, so
     nearly always), no second pass over the chunks is needed;
  3. the mask of each chunk, with a running count of each cut key's occurrences across chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.ranking import order_statistics

# Buckets of the first pass over float32 keys: the top bits above these (the sign bit is always 0: 2¹⁵ buckets).
_COARSE_SHIFT = 16
_FINE_MASK = (1 << _COARSE_SHIFT) - 1
# Buckets either side of a predicted end whose low bits the first pass counts (5 of bfloat16 precision each: about
# 1 % of a tensor's magnitudes).
_GUESS = 2


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
    """Positions ``[start, stop)`` of a stable sort of ``total`` non-negative integer keys (descending with
    ``descending``; :func:`~resumerge.merge.methods.ranking.magnitude_keys` of magnitudes), returned as a mask per
    chunk.

    Over several chunks (int32 keys): for ``k = 0, 1, ...`` while :meth:`wants` ``(k)``, pass every chunk's keys,
    in index order, to :meth:`observe`; then pass them again, in index order, to :meth:`mask` (again after
    :meth:`rewind`). The chunks of different passes may be cut differently. With ``shift`` (at least 13) the keys
    must have that many low bits zero, and one pass is enough. A ``deferred`` window learns ``start``/``stop`` from
    its first pass: :meth:`retarget` sets them after it, and until then they are a forecast that only steers which
    buckets the first pass counts the low bits of (a wrong one costs the second pass, never a wrong mask).

    Over one chunk (``whole``; int32 or int64 keys) no statistics pass is asked for: :meth:`mask` takes the whole
    tensor's keys at once and finds the window in them. ``start``/``stop`` are clamped to ``[0, total]``; an empty
    window masks nothing. Raises ``ValueError`` for a window both ``whole`` and ``deferred``."""

    def __init__(self, total: int, start: int, stop: int, *, descending: bool, shift: int | None = None,
                 deferred: bool = False, whole: bool = False) -> None:
        if whole and deferred:
            raise ValueError("a window over one chunk knows its positions: it is never deferred")
        self.total, self.descending = total, descending
        self.start, self.stop = max(0, start), min(total, stop)
        self._deferred, self._whole = deferred, whole
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
            self._ready = self.trivial or self._whole
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
        """The window's mask (bool, or 1/0 of ``dtype``, built directly in that dtype) over the next chunk's keys, in
        index order (a ``whole`` window's one chunk: all ``total`` keys)."""
        flat = keys.reshape(-1)
        if self._whole and flat.numel() != self.total:
            raise ValueError(f"a window over one chunk masks all {self.total} keys at once, not {flat.numel()}")
        bounds = None if self.trivial or self._whole else self._resolved()
        if self._masked + flat.numel() > self.total:
            raise ValueError(f"masks asked for {self._masked + flat.numel()} keys of {self.total}")
        self._masked += flat.numel()
        if self.trivial:
            fill = torch.zeros if self.start >= self.stop else torch.ones
            return fill(keys.shape, dtype=dtype, device=keys.device)
        if bounds is None:
            lower, upper = self._selected(flat)
        else:
            lower, upper = (None if bound is None else bound.key for bound in bounds)
        # Over one chunk the comparisons write the mask straight into its dtype (no scratch: the footprint is per
        # element); a chunk's numpy comparison is faster but holds the keys' width again while it runs.
        mask = _torch_range_mask(flat, lower, upper, dtype) if self._whole else _range_mask(flat, lower, upper, dtype)
        runs: dict[int, torch.Tensor] = {}
        if bounds is None:
            self._cuts = self._cuts_in(flat, mask, (lower, upper), runs)
        for cut in self._cuts:
            run = runs[cut.key] if cut.key in runs else _positions_of(flat, cut.key)
            seen = self._seen.get(cut.key, 0)
            self._seen[cut.key] = seen + run.numel()
            # The run's occurrences in this chunk are numbers seen, seen + 1, ... of the whole tensor.
            mask[run[: max(0, cut.keep_from - seen)]] = 0
            mask[run[max(0, cut.keep_to - seen):]] = 0
        return mask.reshape(keys.shape)

    def mask_at(self, keys: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                counts: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`mask` of a ``whole`` window gives over all ``total`` ``keys``, at ``positions`` only (flat
        indices, int64, ascending, distinct): the bounds and the counts that place a straddling run taken from all
        the keys, but the mask built for those positions alone (no mask of the rest). ``counts``: the histogram of
        every key ``>> shift`` (:func:`key_counts`) where the window's keys are exact at that shift (bfloat16
        magnitudes): the bounds read from it, with no selection. The window's running state is left as it was."""
        flat = keys.reshape(-1)
        if not self._whole or flat.numel() != self.total:
            raise ValueError(f"a window's mask at some positions reads all {self.total} keys of a whole window")
        positions = positions.to(flat.device)
        picked = flat[positions]
        if self.trivial or not picked.numel():
            fill = torch.zeros if self.start >= self.stop else torch.ones
            return fill(picked.shape, dtype=dtype, device=keys.device)
        if counts is not None and self._exact:
            lower, upper, ends = self.counted_ends(counts)
        else:
            lower, upper = self._selected(flat)
            ends = {key: (int(torch.count_nonzero(flat > key if self.descending else flat < key)),
                          int(torch.count_nonzero(flat == key))) for key in {lower, upper} if key is not None}
        mask = _torch_range_mask(picked, lower, upper, dtype)
        for key, (ahead, length) in sorted(ends.items()):
            cut = _cut(key, ahead, length, self.start, self.stop)
            if cut is None:
                continue
            # Each picked occurrence's number among the run's (index order), as mask() counts them over the whole:
            # the run's occurrences before the last position picked are all it needs.
            run = _positions_of(flat[: int(positions[-1]) + 1], key)
            at = torch.nonzero(picked == key).reshape(-1)
            number = torch.searchsorted(run, positions[at])
            mask[at[(number < cut.keep_from) | (number >= cut.keep_to)]] = 0
        return mask

    def counted_ends(self, counts: torch.Tensor) -> tuple[int | None, int | None, dict[int, tuple[int, int]]]:
        """A window exact at its shift (bfloat16 magnitudes), not trivial: its lower and upper bound keys (None: an
        open end) and, for each bound key, (the keys sorting ahead of its run in the window's direction, the run's
        length), read from ``counts`` (:func:`key_counts` of all the keys) with no pass over the keys."""
        if not self._exact:
            raise ValueError("a window's ends are read from counts only where its keys are exact at its shift")
        found = [None if p is None else self._bound(p, counts.cpu().numpy()) for p in self._positions()]
        lower, upper = (None if bound is None else bound.key for bound in found)
        # (key, keys sorting ahead of its run, the run's length), as _straddling() places a run
        ends = {b.key: (b.greater if self.descending else b.less, self.total - b.less - b.greater)
                for b in found if b is not None}
        return lower, upper, ends

    def rewind(self) -> None:
        """Start :meth:`mask` over again from the first chunk (a second pass that needs the masks: a rescale's
        norms, then the output)."""
        self._masked = 0
        self._seen.clear()

    # -- one chunk -----------------------------------------------------------------------------------------------

    def _selected(self, flat: torch.Tensor) -> tuple[int | None, int | None]:
        """The bound keys of a non-trivial window over the one chunk ``flat``, by selection (None: an open end)."""
        ends = self._positions()
        found = iter(order_statistics(flat, [p for p in ends if p is not None]).tolist())
        low, high = (None if p is None else int(next(found)) for p in ends)
        return low, high

    def _cuts_in(self, flat: torch.Tensor, mask: torch.Tensor, bounds: tuple[int | None, int | None],
                 runs: dict[int, torch.Tensor]) -> tuple[_Cut, ...]:
        """The cuts of the window over the one chunk ``flat``, its range ``mask`` (keys between ``bounds``) built;
        the positions of each bound key that needed them are left in ``runs``."""
        kept = _count(mask)
        if kept == self.stop - self.start:
            return ()  # no run straddles an end
        lower, upper = bounds
        n, cuts = self.total, []
        for key in sorted({bound for bound in bounds if bound is not None}):
            run = runs[key] = _positions_of(flat, key)
            # The keys sorting before the run, in the window's direction. With one open end the mask holds the run
            # and every key beyond it on the other side, so its count gives them; with two, one comparison does.
            if upper is None:  # the mask holds keys >= key
                ahead = kept - run.numel() if self.descending else n - kept
            elif lower is None:  # the mask holds keys <= key
                ahead = n - kept if self.descending else kept - run.numel()
            else:
                ahead = int(torch.count_nonzero(flat > key if self.descending else flat < key))
            cut = _cut(key, ahead, run.numel(), self.start, self.stop)
            if cut is not None:
                cuts.append(cut)
        return tuple(cuts)

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

    def _bound(self, position: int, counts: np.ndarray | None = None) -> _Bound:
        counts = self._counts if counts is None else counts
        assert counts is not None
        cumulative = np.cumsum(counts)
        bucket = int(np.searchsorted(cumulative, position, side="right"))
        below = int(cumulative[bucket - 1]) if bucket else 0
        if self._exact:
            return _Bound(bucket << self._shift, below, self.total - int(cumulative[bucket]))
        fine = np.cumsum(self._fine[bucket])
        low = int(np.searchsorted(fine, position - below, side="right"))
        less = below + (int(fine[low - 1]) if low else 0)
        return _Bound((bucket << _COARSE_SHIFT) | low, less, self.total - below - int(fine[low]))

    def _straddling(self) -> tuple[_Cut, ...]:
        assert self._bounds is not None
        cuts = {}
        for bound in (b for b in self._bounds if b is not None):
            ahead = bound.greater if self.descending else bound.less
            cut = _cut(bound.key, ahead, self.total - bound.less - bound.greater, self.start, self.stop)
            if cut is not None:
                cuts[bound.key] = cut
        return tuple(cuts.values())


def key_counts(keys: torch.Tensor, shift: int) -> torch.Tensor:
    """The histogram (int64) of ``keys >> shift`` over the ``2 ** (31 - shift)`` buckets a window of keys exact at
    ``shift`` counts (:meth:`StreamedWindow.mask_at`'s ``counts``)."""
    return torch.bincount(keys.reshape(-1) >> shift, minlength=1 << (31 - shift))


def _cut(key: int, ahead: int, run: int, start: int, stop: int) -> _Cut | None:
    """The cut of a run of ``run`` keys equal to ``key``, ``ahead`` keys sorting before it in the window's
    direction, when it straddles an end of the window ``[start, stop)``; None when it lies wholly inside or out."""
    # The j-th occurrence (index order) of the run holds sort position ahead + j.
    keep_from, keep_to = max(0, start - ahead), max(0, stop - ahead)
    return _Cut(key, keep_from, keep_to) if keep_from > 0 or keep_to < run else None


def _range_mask(flat: torch.Tensor, lower: int | None, upper: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``lower <= flat <= upper`` (None: an open end; not both None) as a mask of ``dtype``, for a chunk of int32
    keys: on the CPU by :func:`_between`, elsewhere by :func:`_torch_range_mask`."""
    if flat.device.type == "cpu":
        # An open end is the end of the keys' range (they are non-negative).
        return _between(flat, 0 if lower is None else lower,
                        torch.iinfo(flat.dtype).max if upper is None else upper, dtype)
    return _torch_range_mask(flat, lower, upper, dtype)


def _torch_range_mask(flat: torch.Tensor, lower: int | None, upper: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``lower <= flat <= upper`` (None: an open end; not both None) as a mask of ``dtype``, by torch's comparisons:
    a one-sided mask is written straight into ``dtype``, without scratch."""
    if lower is not None and upper is not None:
        both = flat == lower if lower == upper else (flat >= lower).logical_and_(flat <= upper)
        return both if dtype == torch.bool else both.to(dtype)
    out = torch.empty(flat.shape, dtype=dtype, device=flat.device)
    if lower is not None:
        return torch.ge(flat, lower, out=out)
    assert upper is not None
    return torch.le(flat, upper, out=out)


_SAME_WIDTH_INT = MappingProxyType({8: "int64", 4: "int32", 2: "int16", 1: "int8"})


def _count(mask: torch.Tensor) -> int:
    # count_nonzero is fast on bool and integer tensors but several times slower on floats; a 0/1 float mask has
    # exactly its ones nonzero in the bit pattern, so count through an integer view of the same width.
    if mask.dtype.is_floating_point:
        mask = mask.view(getattr(torch, _SAME_WIDTH_INT[mask.element_size()]))
    return int(torch.count_nonzero(mask))


def _between(flat: torch.Tensor, lower: int, upper: int, dtype: torch.dtype) -> torch.Tensor:
    """``lower <= flat <= upper`` for a chunk of non-negative int32 CPU keys, as a mask of ``dtype``."""
    # One unsigned comparison (keys below `lower` wrap round to large values) in numpy: five times as fast as
    # torch's two comparisons and logical and, and three times as fast as one torch comparison written into a
    # float32 mask.
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
