"""The verdict's rules and thresholds: every number a verdict compares is in the report, beside the threshold.

- broken: a non-finite value in the merge (static) or its logits; the merge's NLL above ``uniform_factor`` ×
  ln(vocabulary), the NLL of guessing every token uniformly (an absolute bound, which holds with no base or parent
  to compare with: a random model's NLL is ln(vocabulary) within a fraction of a percent, a trained one's far
  below it; where every model compared with is as far above it, random weights, they are judged against each
  other only); its NLL above ``nll_factor`` × the highest NLL of the base and parents, or × the base's own; with two
  parents or more, above ``nll_factor`` × the best parent's (a merge as bad as its worst parent: a good parent
  merged with a destroyed one); or a layer named by the localising pass: the first layer whose output, on the
  reference's input, departs from every other model's by more than ``depart_factor`` × the spread of those models
  among themselves and more than ``depart_floor`` (relative to the layer's own change of its input).
- no effect: the base given and parents that differ from it (KL(B‖P) above ``differs_kl``), and KL(B‖merge) at
  most ``no_effect_share`` × the smallest such KL(B‖P): the merge is indistinguishable from the base; the base
  given and no parent that differs from it (none given: ``check MODEL --base BASE``), and KL(B‖merge) at most
  ``differs_kl``: the model is its base; or, with
  two parents or more, the merge's KL from one parent at most ``no_effect_share`` × its KL from the farthest one
  (above ``differs_kl``): it is that parent; or a whole kind of tensors the parents moved and the merge did not
  (static pass, :data:`~resumerge.analyses.check.static.UNMOVED_RATIO`).
- works: neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from resumerge.analyses.check.report import BROKEN, NO_EFFECT, WORKS, StaticFigures
from resumerge.analyses.check.static import UNMOVED_RATIO
from resumerge.forward.compared.passes import PassFigures

THRESHOLDS: Mapping[str, float] = MappingProxyType({
    "nll_factor": 1.5,
    "uniform_factor": 1.1,
    "depart_factor": 4.0,
    "depart_floor": 0.25,
    "differs_kl": 1e-3,
    "no_effect_share": 0.02,
    "unmoved_ratio": UNMOVED_RATIO,
})


def judge(roles: Sequence[str], paths: Sequence[str], static: StaticFigures,
          figures: PassFigures | None, vocab: int | None = None) -> tuple[str, list[str], int | None]:
    """(verdict, the reasons with their figures, the broken layer or None); ``vocab``: the merge's vocabulary
    size (its logits' width), for the absolute bound (None: not known, not applied)."""
    t = THRESHOLDS
    broken: list[str] = []
    if static.nonfinite:
        shown = ", ".join(static.nonfinite[:3]) + (" …" if len(static.nonfinite) > 3 else "")
        broken.append(f"{len(static.nonfinite)} tensor(s) of the merge hold NaN or Inf: {shown}")
    layer = None
    if figures is not None:
        others = [i for i in range(1, len(roles))]
        if not math.isfinite(figures.nll[0]):
            broken.append("the merge's logits are not finite")
        broken.extend(_nll_bounds(roles, paths, figures.nll, vocab))
        layer = _named_layer(figures, others)
        if layer is not None:
            far = min(figures.depart[i][layer] for i in others)
            broken.append(f"layer {layer}: on the same input its output departs from every other model's by "
                          f"{far:.4g} or more (their spread {figures.spread[layer]:.4g}; thresholds "
                          f"{t['depart_factor']} × spread and {t['depart_floor']})")
    if broken:
        return BROKEN, broken, layer
    no_effect = list(static.unmoved)
    if figures is not None:
        no_effect.extend(_no_effect(roles, paths, figures))
    if no_effect:
        return NO_EFFECT, no_effect, None
    reasons = []
    if figures is not None and len(roles) > 1:
        closest = min(range(1, len(roles)), key=lambda i: figures.kl[i] or 0.0)
        reasons.append(f"closest to the {roles[closest]} {paths[closest]} (KL {figures.kl[closest]:.4g} nats/token)")
    return WORKS, reasons, None


def _nll_bounds(roles: Sequence[str], paths: Sequence[str], nll: Sequence[float], vocab: int | None
                ) -> list[str]:
    """The merge's NLL (``nll[0]``) held to the uniform guess and to the other models' NLLs (see the module
    docstring): the reasons it is broken, none where it is not."""
    t, merge, found = THRESHOLDS, nll[0], []
    others = range(1, len(roles))
    # Held to the uniform guess alone, or where a model it is compared with does better than a guess: models that
    # are all worse than one (random weights) are judged against each other only.
    best = min((nll[i] for i in others), default=None)
    if vocab is not None and vocab > 1 and merge > t["uniform_factor"] * math.log(vocab) and \
            (best is None or best <= t["uniform_factor"] * math.log(vocab)):
        found.append(f"NLL {merge:.4f} > {t['uniform_factor']} × {math.log(vocab):.4f}, the NLL of guessing "
                     f"uniformly among its {vocab:,} tokens (ln {vocab:,}): worse than a guess")
    worst = max(others, key=lambda i: nll[i], default=None)
    if worst is not None and merge > t["nll_factor"] * nll[worst]:
        found.append(f"NLL {merge:.4f} > {t['nll_factor']} × {nll[worst]:.4f}, the highest of the base and parents")
        return found
    if "base" in roles and merge > t["nll_factor"] * nll[roles.index("base")]:
        found.append(f"NLL {merge:.4f} > {t['nll_factor']} × {nll[roles.index('base')]:.4f}, its base's")
    parents = [i for i, r in enumerate(roles) if r == "parent"]
    if len(parents) >= 2:
        best = min(parents, key=lambda i: nll[i])
        bad = max(parents, key=lambda i: nll[i])
        if merge > t["nll_factor"] * nll[best]:
            found.append(f"as bad as its worst parent {paths[bad]} (NLL {nll[bad]:.4f}): NLL {merge:.4f} > "
                         f"{t['nll_factor']} × {nll[best]:.4f}, its best parent {paths[best]}'s")
    return found


def _named_layer(figures: PassFigures, others: list[int]) -> int | None:
    t = THRESHOLDS
    if not others:
        return None
    for layer, spread in enumerate(figures.spread):
        bar = max(t["depart_factor"] * spread, t["depart_floor"])
        if all(figures.depart[i][layer] > bar for i in others):
            return layer
    return None


def _no_effect(roles: Sequence[str], paths: Sequence[str], figures: PassFigures) -> list[str]:
    t = THRESHOLDS
    found = []
    parents = [i for i, r in enumerate(roles) if r == "parent"]
    if "base" in roles:
        base = roles.index("base")
        differing = [i for i in parents if (figures.base_kl[i] or 0.0) > t["differs_kl"]]
        base_kl = figures.kl[base] or 0.0
        if differing:
            nearest = min((figures.base_kl[i] or 0.0) for i in differing)
            if base_kl <= t["no_effect_share"] * nearest:
                found.append(f"indistinguishable from the base: KL(base‖merge) {base_kl:.4g} ≤ "
                             f"{t['no_effect_share']} × {nearest:.4g}, the nearest differing parent's")
        elif base_kl <= t["differs_kl"]:  # no parent moved from the base (none given): the merge did not either
            found.append(f"indistinguishable from the base: KL(base‖merge) {base_kl:.4g} ≤ {t['differs_kl']:g}, "
                         "and no parent differs from the base to compare with")
    if len(parents) >= 2:
        farthest = max(figures.kl[i] or 0.0 for i in parents)
        for i in parents:
            mine = figures.kl[i] or 0.0
            if farthest > t["differs_kl"] and mine <= t["no_effect_share"] * farthest:
                found.append(f"indistinguishable from the parent {paths[i]}: KL {mine:.4g} ≤ "
                             f"{t['no_effect_share']} × {farthest:.4g}, its KL from the farthest parent")
    return found
