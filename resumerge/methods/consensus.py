"""TIES sign election ("sum" consensus), shared by the TIES-style task-arithmetic methods and SCE."""

from __future__ import annotations

from resumerge.torch_import import torch


def sign_consensus_mask(deltas: torch.Tensor, *, int8: bool = False) -> torch.Tensor:
    """Return a bool mask marking the entries of ``deltas`` that agree with the elected sign.

    ``deltas`` is stacked along dim 0 (one task vector per model, usually already weighted). The elected
    sign of a position is the sign of the sum over models, with a zero sum counting as positive; an entry
    agrees when its own sign equals it, so exact zeros (and NaN) never agree. ``int8`` is mergekit's
    ``int8_mask``, which only lowers the memory of its intermediate sign tensor; there is no such tensor here, so
    it is accepted and changes nothing.
    """
    # sign(x) equals the elected ±1 exactly when x lies strictly on the elected side of zero, so two comparisons
    # combined in place replace mergekit's sign tensor and its ±1 arithmetic (same mask, a third of the time).
    positive = deltas.sum(dim=0) >= 0
    agree = (deltas > 0).logical_and_(positive)
    return agree.logical_or_((deltas < 0).logical_and_(positive.logical_not_()))


def sign_consensus_weights(deltas: torch.Tensor) -> torch.Tensor:
    """Return :func:`sign_consensus_mask` as 1/0 in ``deltas``' dtype (a float dtype), built without a bool pass.

    Multiplying by it equals mergekit's multiplication by its bool mask bit for bit (kept entries unchanged,
    dropped ones ±0 by their sign); converting a bool mask costs a pass as long as building it.
    """
    # The elected sign as ±1 (a NaN sum elects −1, as `sum >= 0` is false for it); an entry agrees exactly when
    # its product with ±1 (exact: a sign flip) is strictly positive, so zeros and NaN never agree.
    elected = deltas.sum(dim=0).ge_(0).mul_(2).sub_(1)
    return torch.mul(deltas, elected).gt_(0)
