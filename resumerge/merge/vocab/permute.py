"""Re-index vocabulary-axis tensors (embed_tokens, lm_head) onto the output vocabulary before a merge.

mergekit's ``PermutedVocabulary`` rules, vectorised. For each input model, output row ``j`` is the model's own row
for token ``j`` when it has the token and the token is not forced; otherwise it is the token's *default row*:

* a ``tokenizer.tokens`` entry with a source: that model's row (or another token's row, ``model_token``), or
  zeros (``kind: zero``); ``force: true`` makes every model take it;
* else, among the models of this tensor: the only model that has the token; zeros if none has it; the base
  model's row if the base is merged here and has it; else the mean over the models that have it, summed in the
  order of ``keys`` and divided by their count, exactly as mergekit does (so results match bit for bit).

Padding rows (``pad_to_multiple_of``) are the mean, per model, of that model's aligned real rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from resumerge.errors import ModelInputError
from resumerge.machine.torch_import import torch
from resumerge.merge.vocab.alignment import Runs, VocabAlignment, check_keys

# Rows gathered per step: bounds the temporary copy to a slice of the matrix instead of all of it.
_CHUNK_ROWS = 16384
# Runs of consecutive source rows at least this long are copied as slices (memcpy speed) instead of gathered.
_SLICE_MIN_ROWS = 32


def align_rows(
    alignment: VocabAlignment,
    tensors: Sequence[torch.Tensor],
    keys: Sequence[str],
    *,
    axis: int = 0,
    base: str | None = None,
) -> list[torch.Tensor]:
    """Return one tensor per input, its vocabulary axis re-indexed to the output vocabulary (``vocab_size`` long).

    ``tensors[i]`` is model ``keys[i]``'s tensor, with the vocabulary along ``axis`` and at least as many rows as
    the alignment maps into it; all must agree on the other dimensions. ``keys`` order decides the summation order
    of averaged rows (pass the slice's sources in config order). Every result is contiguous, on the first input's
    device, with the dtype ``torch.promote_types`` gives over all inputs (the inputs' dtype when they share one,
    as after ``dtype:``). ``base`` is the slice's own base model when it sets one (mergekit's slice-level
    ``base_model``); None means ``alignment.base``. Pure and deterministic: the output depends only on the arguments.

    Raises ``ValueError`` for keys the alignment does not know, :class:`ModelInputError` for tensors whose shapes
    do not fit, and :class:`~resumerge.errors.ConfigError` when a configured source model is not among ``keys``
    but is needed.
    """
    keys = list(keys)
    if len(tensors) != len(keys) or not keys:
        raise ValueError(f"need one tensor per key, got {len(tensors)} tensors for {len(keys)} keys")
    check_keys(alignment, keys)
    views = _vocab_first(tensors, keys, axis)
    dtype = views[0].dtype
    for view in views[1:]:
        dtype = torch.promote_types(dtype, view.dtype)
    device = views[0].device
    sources = [torch.from_numpy(alignment.source_rows(k).copy()).to(device) for k in keys]
    for key, view, src in zip(keys, views, sources):
        _check_rows(alignment, key, view, src)

    n = alignment.real_size
    present = torch.stack([s >= 0 for s in sources])
    count = present.sum(dim=0)
    forced = torch.zeros(n, dtype=torch.bool, device=device)
    configured = torch.zeros(n, dtype=torch.bool, device=device)
    for override in alignment.overrides:
        configured[override.token_id] = True
        forced[override.token_id] = override.force
    needs_default = forced | (count < len(keys))
    default_ids = torch.nonzero(needs_default).flatten()
    base_key = base if base is not None else alignment.base
    defaults = _default_rows(alignment, base_key, views, keys, sources, present, configured, default_ids, dtype)

    results = []
    for key, view, src, has in zip(keys, views, sources, present):
        # Every row is written below (own rows, then defaults, then padding), so no zero fill is needed.
        out = torch.empty((alignment.vocab_size, *view.shape[1:]), dtype=dtype, device=device)
        _copy_own_rows(out, view, src, has, alignment.runs[alignment.models.index(key)])
        # Rows that are not the model's own take their default (the model lacks the token, or it is forced);
        # this overwrites the own rows of forced tokens copied above.
        borrowed = (~has | forced)[default_ids]
        if bool(borrowed.any()):
            out.index_copy_(0, default_ids[borrowed], defaults[borrowed])
        if alignment.vocab_size > n:
            # As mergekit (after https://nlp.stanford.edu/~johnhew/vocab-expansion.html): padding = mean real row.
            out[n:] = torch.mean(out[:n], dim=0)
        results.append(out.movedim(0, axis).contiguous() if axis else out)
    return results


def _vocab_first(tensors: Sequence[torch.Tensor], keys: list[str], axis: int) -> list[torch.Tensor]:
    if any(axis < 0 or axis >= t.ndim for t in tensors):
        raise ModelInputError(f"vocabulary axis {axis} is out of range for shapes {[tuple(t.shape) for t in tensors]}")
    views = [t.movedim(axis, 0) if axis else t for t in tensors]
    if any(v.shape[1:] != views[0].shape[1:] for v in views):
        raise ModelInputError(
            "vocabulary tensors differ outside the vocabulary axis: "
            + ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(keys, tensors))
        )
    return views


def _check_rows(alignment: VocabAlignment, key: str, view: torch.Tensor, src: torch.Tensor) -> None:
    needed = int(src.max()) + 1 if src.numel() else 0
    for override in alignment.overrides:
        if override.model == key:
            needed = max(needed, override.row + 1)
    if view.shape[0] < needed:
        raise ModelInputError(
            f"the vocabulary tensor of {key} has {view.shape[0]} rows but its tokenizer needs {needed}",
            hint="the model's embedding rows and its config's vocab_size disagree",
        )


def _default_rows(
    alignment: VocabAlignment,
    base_key: str | None,
    views: list[torch.Tensor],
    keys: list[str],
    sources: list[torch.Tensor],
    present: torch.Tensor,
    configured: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The default row of each token in ``ids`` (sorted output ids), by mergekit's order of preference."""
    defaults = torch.zeros((ids.numel(), *views[0].shape[1:]), dtype=dtype, device=views[0].device)
    if not ids.numel():
        return defaults
    position = {int(t): i for i, t in enumerate(ids.tolist())}
    auto = ~configured[ids]
    has = present[:, ids]
    cnt = has.sum(dim=0)  # how many models have each token
    for index in range(len(keys)):
        # Exactly one model has the token: its row (whether or not it is the base).
        only = auto & (cnt == 1) & has[index]
        _gather_into(defaults, torch.nonzero(only).flatten(), views[index], sources[index][ids[only]])
    averaged = auto & (cnt >= 2)
    if base_key is not None and base_key in keys:
        base = keys.index(base_key)
        from_base = averaged & has[base]
        _gather_into(defaults, torch.nonzero(from_base).flatten(), views[base], sources[base][ids[from_base]])
        averaged &= ~has[base]
    if bool(averaged.any()):
        rows = torch.nonzero(averaged).flatten()
        total = torch.zeros((rows.numel(), *views[0].shape[1:]), dtype=dtype, device=defaults.device)
        for index in range(len(keys)):
            mask = has[index][rows]
            picked = rows[mask]
            # Same sequence of elementwise additions as mergekit's per-token loop: bit-identical sums.
            total[mask] = total[mask] + views[index][sources[index][ids[picked]]]
        counts = cnt[rows]
        for c in torch.unique(counts).tolist():
            # Division by a Python int, as mergekit's ``embed /= count``, so rounding matches.
            group = counts == c
            total[group] = total[group] / int(c)
        defaults.index_copy_(0, rows, total)
    for override in alignment.overrides:
        slot = position.get(override.token_id)
        if slot is None:
            continue  # every model has it and it is not forced: the override is never used
        if override.model is None:
            defaults[slot] = 0
        else:
            defaults[slot] = views[keys.index(override.model)][override.row]
    return defaults


def _copy_own_rows(out: torch.Tensor, view: torch.Tensor, src: torch.Tensor, has: torch.Tensor, runs: Runs) -> None:
    """Copy every row the model has into ``out``: long runs of consecutive rows as slices, the rest by gathering."""
    covered = torch.zeros_like(has)
    for start, length, first in runs:
        if first >= 0 and length >= _SLICE_MIN_ROWS:
            out[start : start + length] = view[first : first + length]
            covered[start : start + length] = True
    rest = torch.nonzero(has & ~covered).flatten()
    _gather_into(out, rest, view, src[rest])


def _gather_into(out: torch.Tensor, targets: torch.Tensor, view: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[targets] = view[rows]`` (cast to ``out``'s dtype), a chunk at a time to bound the temporary copy."""
    for start in range(0, targets.numel(), _CHUNK_ROWS):
        chunk = slice(start, start + _CHUNK_ROWS)
        out.index_copy_(0, targets[chunk], view.index_select(0, rows[chunk]).to(out.dtype))
