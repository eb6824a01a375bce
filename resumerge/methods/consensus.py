"""TIES sign election ("sum" consensus), shared by the TIES-style task-arithmetic methods and SCE."""

from __future__ import annotations

import torch


def sign_consensus_mask(deltas: torch.Tensor, *, int8: bool = False) -> torch.Tensor:
    """Return a bool mask marking the entries of ``deltas`` that agree with the elected sign.

    ``deltas`` is stacked along dim 0 (one task vector per model, usually already weighted). The elected
    sign of a position is the sign of the sum over models, with a zero sum counting as positive; an entry
    agrees when its own sign equals it, so exact zeros never agree. ``int8`` only lowers the memory of the
    intermediate sign tensor (mergekit's ``int8_mask``); the mask is the same either way.
    """
    sign_dtype = torch.int8 if int8 else deltas.dtype
    signs = deltas.sign().to(sign_dtype)
    elected = (deltas.sum(dim=0) >= 0).to(sign_dtype) * 2 - 1
    return signs == elected
