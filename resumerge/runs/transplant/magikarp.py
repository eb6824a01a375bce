"""``--magikarp``: the tokens a model has trained well (Land & Bartolo, "Fishing for Magikarp: Automatically Detecting
Under-trained Tokens in Large Language Models", arXiv:2405.05417), as mergekit-tokensurgeon 0.1.5 finds them.

Unused = rows no token maps to, and tokens whose text names an unused or reserved token. With a head: tokens whose
input embedding's L2 norm is under the 1 % quantile are discarded. With unused rows: tokens whose input embedding
(and head row) is closer in cosine to the unused rows' mean than max(0.5, the 99 % quantile) are discarded too. A pure
function of the matrices; the planning reads them once (:mod:`~resumerge.runs.transplant.prepare`).
"""

from __future__ import annotations

from collections.abc import Mapping

from resumerge.machine.torch_import import torch
from resumerge.runs.transplant.tokens import Normalized, text_of

QUANTILE = 0.01
# The cosine threshold never drops below this, however alike the model's rows are.
_FLOOR = 0.5


def well_trained(ids: Mapping[Normalized, int], embed: torch.Tensor,
                 head: torch.Tensor | None) -> set[Normalized]:
    """The tokens of ``ids`` (normalized token -> row) the model has trained well."""
    unused = set(range(embed.shape[0])) - set(ids.values())
    unused |= {i for t, i in ids.items() if "unused_token" in text_of(t) or "reserved_special_token" in text_of(t)}
    bad = set(unused)
    if head is not None:
        norms = embed.norm(dim=1).float()
        bad |= set(torch.where(norms < torch.quantile(norms, QUANTILE))[0].tolist())
    if unused:
        rows = sorted(unused)
        for matrix in (embed, head):
            if matrix is None:
                continue
            mean = matrix[rows].mean(dim=0)
            similar = torch.nn.functional.cosine_similarity(matrix, mean.unsqueeze(0), dim=1).float()
            threshold = max(float(torch.quantile(similar, 1 - QUANTILE)), _FLOOR)
            bad |= set(torch.where(similar > threshold)[0].tolist())
    return {t for t, i in ids.items() if i not in bad}
