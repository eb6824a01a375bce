"""Exact, deterministic ranking for the rank-based methods: TIES, breadcrumbs, DELLA, SCE and arcee_fusion.

Sorting a whole task vector to find one threshold costs O(n log n) and most of a merge's time; these helpers find
the order statistics a method needs by an O(n) selection, from which the rank window
(:class:`~resumerge.merge.methods.rankstream.StreamedWindow`) builds its masks by comparison. Wherever equal values
compete for a place, they are ordered **by index**, as a stable sort orders them, so every mask depends only on
the values: the same on CPU and GPU, for any thread count. (mergekit ranks with torch's unstable sort, whose
order among equal values is an accident of the kernel and differs between CPU and GPU.)

Magnitudes are ranked through integer keys (:func:`magnitude_keys`): the IEEE-754 bit pattern of a
non-negative float, read as a signed integer of the same width, orders exactly as the values do, with NaN
above +inf as ``torch.sort`` places it. Integer selection has no NaN cases to handle and runs about twice as fast
as float selection in numpy.

On the CPU, selection and row sorting use numpy (``numpy.partition``, ``ndarray.sort``: vectorised introselect
and quicksort, several times faster than ``torch.kthvalue`` / ``torch.sort`` there); on any other device the
same functions run in torch, so ``--device cuda`` keeps the work on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

from resumerge.machine.torch_import import dtype_name, torch

_KEY_DTYPES = MappingProxyType({  # dtype names: torch is imported on first use
    "float64": "int64",
    "float32": "int32",
    # Half types widen to float32 exactly, so their keys order (and tie) exactly as the half values do.
    "float16": "int32",
    "bfloat16": "int32",
})


def magnitude_keys(magnitudes: torch.Tensor) -> torch.Tensor:
    """Return integer keys that order (and tie) exactly as the non-negative ``magnitudes`` do.

    float64 gives int64 keys, every other float type int32 keys (half types are widened to float32 first, which
    is exact). Keys of a negative value order wrongly, so pass magnitudes (``abs()``), never signed values.
    Raises ``TypeError`` for a non-float tensor.
    """
    key_name = _KEY_DTYPES.get(dtype_name(magnitudes.dtype))
    if key_name is None:
        raise TypeError(f"magnitudes must be a floating-point tensor, got {magnitudes.dtype}")
    if magnitudes.dtype in (torch.float16, torch.bfloat16):
        magnitudes = magnitudes.float()
    return magnitudes.contiguous().view(getattr(torch, key_name))


def exact_key_shift(dtype: torch.dtype) -> int | None:
    """How many low bits are zero in every :func:`magnitude_keys` key of magnitudes of ``dtype`` widened to
    float32, when that many make a 2¹⁵-bucket histogram of ``key >> shift`` exact; else None.

    A bfloat16 is the upper half of a float32, so its keys shifted right by 16 lose nothing and order and tie
    exactly as the keys do. (A float16's keys have 13 zero bits, which leaves 2¹⁸ buckets: too many to count
    per chunk, so float16 ranks like float32, in two histograms.)
    """
    return 16 if dtype == torch.bfloat16 else None


def order_statistics(values: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """Return the entries at the 0-based ``positions`` of the ascending sort of ``values`` (flattened).

    The result is a 1-D tensor of ``values``' dtype and device, one entry per position. Values, not indices, are
    returned, so the result is the same whatever order a sort would give equal values. NaN sorts above +inf, as
    in ``torch.sort``. Raises ``IndexError`` for a position outside ``[0, numel)``.
    """
    flat = values.reshape(-1)
    n = flat.numel()
    for position in positions:
        if not 0 <= position < n:
            raise IndexError(f"order statistic {position} of {n} values")
    if not positions:
        return flat.new_empty(0)
    if flat.device.type == "cpu":
        return _select_numpy(flat, positions)
    return _select_torch(flat, positions)


def _select_numpy(flat: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    # numpy has no bfloat16 and its float16 selection is slow; widening to float32 is exact.
    wide = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    # One position per call: numpy's vectorised selection handles a single kth (several kth in one call take a
    # generic path about five times slower). After selecting position p, the p entries before it are the p
    # smallest, so each smaller position is selected within that prefix only.
    descending = sorted(set(positions), reverse=True)
    work = np.partition(wide.numpy(), [descending[0]])
    for position, prefix in zip(descending[1:], descending):
        work[:prefix].partition([position])
    return torch.from_numpy(work[list(positions)]).to(flat.dtype)


def _select_torch(flat: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    if flat.dtype == torch.int32:
        return _select_counted(flat, positions)
    if not flat.dtype.is_floating_point:
        # kthvalue is a radix selection; integer keys have no NaN whose placement could differ.
        return torch.stack([torch.kthvalue(flat, position + 1).values for position in positions])
    # Float values: torch.sort's order (NaN last) is the contract, so use it.
    return torch.sort(flat).values[list(positions)]


# The int32 selection's histogram: 2¹⁶ buckets of a key's upper half (then of its lower half within one bucket),
# counted over chunks of 2²⁰ keys so that its scratch stays a few MB whatever the tensor (the footprints count one
# copy of the keys for a selection, which this stays below).
_HALF = 1 << 16
_COUNT_CHUNK = 1 << 20


def _select_counted(flat: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
    """int32 order statistics by counting: a histogram of every key's upper 16 bits finds the bucket of each
    position and its rank there, a histogram of the lower 16 bits of that bucket's keys the value; exact, as a sort
    is. On CUDA ``torch.kthvalue`` selects one slice in one thread block, so a whole task vector of millions of keys
    went through a single block (9.5 ms a call on an H100, most of a TIES search's GPU time); ``bincount`` spreads
    over the device."""
    device = flat.device
    upper = torch.zeros(_HALF, dtype=torch.int64, device=device)
    for start in range(0, flat.numel(), _COUNT_CHUNK):
        # an arithmetic shift: the upper half of a negative key is negative, and +2¹⁵ keeps the buckets in order
        upper += torch.bincount((flat[start:start + _COUNT_CHUNK] >> 16) + (_HALF >> 1), minlength=_HALF)
    ends = upper.cumsum(0)
    wanted = torch.tensor(list(positions), dtype=torch.int64, device=device)
    buckets = torch.searchsorted(ends, wanted, right=True)
    ranks = wanted - (ends[buckets] - upper[buckets])
    found = []
    for bucket, rank in zip(buckets.tolist(), ranks.tolist(), strict=True):
        high = bucket - (_HALF >> 1)
        lower = torch.zeros(_HALF, dtype=torch.int64, device=device)
        for start in range(0, flat.numel(), _COUNT_CHUNK):
            part = flat[start:start + _COUNT_CHUNK]
            lower += torch.bincount(part[(part >> 16) == high] & (_HALF - 1), minlength=_HALF)
        low = int(torch.searchsorted(lower.cumsum(0), torch.tensor([rank], device=device), right=True))
        found.append((high << 16) | low)  # a Python int: (-2¹⁶ · k) | low is -2¹⁶ · k + low, as the key is
    return torch.tensor(found, dtype=flat.dtype, device=device)


def stable_order(keys: torch.Tensor, shift: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return, for each row of a 2-D tensor, the columns of its keys in stable ascending order (int64).

    ``order[r, j]`` is the column holding row ``r``'s ``j``-th smallest key; equal keys keep column order. int32
    keys are packed with their column into unique keys, so one unstable sort per row gives the stable order; other
    key types fall back to ``torch.sort(stable=True)``. ``shift``: the low bits that are zero in every key (as
    :func:`exact_key_shift` gives them for the keys' source dtype), dropped first; where what is left and the
    column fit in 31 bits (bfloat16's keys and rows up to 2¹⁶ columns) the packed keys are int32, which sort in
    about half the time of int64 ones. ``out``: a contiguous int64 buffer of at least ``keys.numel()`` entries the
    order of int32 keys is built in on the CPU (and returned as a view of it), reused by a caller that orders block
    after block: a fresh buffer of a block's size lies above the allocator's mmap threshold, and its pages, zeroed
    by the kernel at first touch, cost about what the sort does. Raises ``ValueError`` unless ``keys`` is 2-D.
    """
    if keys.dim() != 2:
        raise ValueError(f"ranking by row needs a 2-D tensor of rows, got shape {tuple(keys.shape)}")
    rows, cols = keys.shape
    if keys.numel() == 0:
        return torch.empty((rows, cols), dtype=torch.int64, device=keys.device)
    index_bits = max(1, (cols - 1).bit_length())
    order = None if out is None else out[: rows * cols].view(rows, cols)
    if keys.dtype == torch.int32 and shift is not None and index_bits <= shift:
        # A non-negative int32 key has 31 bits, the `shift` low ones zero: (key >> shift)·2^index_bits + column
        # is a non-negative int32, unique, and orders by (key, column) as the int64 packing below does.
        narrow = keys >> shift
        narrow <<= index_bits
        narrow |= torch.arange(cols, dtype=torch.int32, device=keys.device)
        narrow = _sort_rows(narrow).bitwise_and_((1 << index_bits) - 1)
        return narrow.to(torch.int64) if order is None else order.copy_(narrow)
    if keys.dtype == torch.int32 and index_bits <= 32:
        # |key| < 2³¹ and column < 2^index_bits ≤ 2³², so key·2^index_bits + column fits in int64 and orders by
        # (key, column): every packed key is unique and any sort of them is the stable sort of the keys.
        packed = keys.to(torch.int64) if order is None else order.copy_(keys)
        columns = torch.arange(cols, device=keys.device)
        if packed.device.type == "cpu" and index_bits <= _DOUBLE_INDEX_BITS:
            # (key + 2³¹)·2^index_bits + column + 2⁵² is below 2⁵³ and at least 2⁵²: the bit pattern of a positive
            # normal double of exponent 1, and such doubles order exactly as their patterns do as integers. numpy
            # sorts rows of doubles about 15 % faster than rows of int64 (normal numbers: no denormal mode can
            # flatten them); the mask below keeps the column alone. One pass builds them (an integer add with
            # alpha = 2^index_bits is the shift and the add in one, exactly: nothing overflows).
            torch.add(columns.add_((1 << 52) + ((1 << 31) << index_bits)), packed, alpha=1 << index_bits, out=packed)
            return _sort_rows(packed, as_doubles=True).bitwise_and_((1 << index_bits) - 1)
        packed <<= index_bits
        packed |= columns
        return _sort_rows(packed).bitwise_and_((1 << index_bits) - 1)
    return torch.sort(keys, dim=1, stable=True).indices


# Column bits that leave an int32 key moved to 0 … 2³² − 1 and its column below bit 52, a double's lowest
# exponent bit.
_DOUBLE_INDEX_BITS = 52 - 32


def _sort_rows(packed: torch.Tensor, *, as_doubles: bool = False) -> torch.Tensor:
    # Sorts each row of unique int32 or int64 keys; on the CPU in place, where numpy's vectorised sort beats
    # torch.sort (as_doubles: int64 keys that are the patterns of positive normal doubles, sorted as those).
    if packed.device.type == "cpu":
        (packed.numpy().view(np.float64) if as_doubles else packed.numpy()).sort(axis=1)
        return packed
    return torch.sort(packed, dim=1).values
