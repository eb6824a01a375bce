"""A surrogate that ranks structure candidates before they are scored: gradient-boosted trees (scikit-learn's
``GradientBoostingRegressor``, a fixed seed: the same ranking from the same figures) over each candidate's edits
(per edit: repeat or skip, where it starts and how long it is, as fractions of the base's layers; then its size),
trained on the candidates scored so far. With the genome's ``surrogate: K``, each beam round scores only the K
children the surrogate ranks best. :func:`rank_correlation` is how well it ranks: Spearman's rank correlation between
its predictions and the figures of the scored candidates it was not trained on (every other one, by number).

scikit-learn is optional (the search without ``surrogate`` never imports it); a genome asking for a surrogate where it
is not installed is refused up front."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from resumerge.errors import UsageError
from resumerge.runs.evolve.shapes.genome import REPEAT, SKIP, Shape

_SLOTS = 4  # edits described; a candidate of more is described by its first four and its size


def features(shape: Shape, layers: int) -> list[float]:
    """The candidate as the surrogate reads it."""
    found: list[float] = []
    for e in shape.edits[:_SLOTS]:
        found += [{REPEAT: 1.0, SKIP: -1.0}.get(e.kind, 0.0), e.first / layers, (e.after - e.first) / layers,
                  float(e.source), e.scale]
    found += [0.0] * (5 * _SLOTS - len(found))
    return [*found, len(shape.path(layers)) / layers]


def _regressor() -> Any:
    try:
        from sklearn.ensemble import GradientBoostingRegressor
    except ImportError:
        raise UsageError("a structure genome's surrogate needs scikit-learn", hint="pip install scikit-learn, or "
                         "leave out the genome's surrogate") from None
    return GradientBoostingRegressor(n_estimators=100, max_depth=3, learning_rate=0.1, random_state=0)


def require() -> None:
    """Refuse (exit 2) a surrogate where scikit-learn is not installed."""
    _regressor()


def ranked(scored: Sequence[tuple[Shape, float]], unscored: Sequence[Shape], layers: int) -> list[Shape]:
    """``unscored`` ordered best first (lowest predicted objective; ties by name) by a surrogate trained on
    ``scored`` (each candidate and its objective)."""
    model = _regressor().fit([features(s, layers) for s, _ in scored], [y for _, y in scored])
    predicted = model.predict([features(s, layers) for s in unscored]) if unscored else []
    return [s for _, _, s in sorted(zip(map(float, predicted), (s.key for s in unscored), unscored))]


def rank_correlation(scored: Sequence[tuple[Shape, float]], layers: int) -> dict[str, Any] | None:
    """Spearman's rank correlation between the surrogate's predictions and the figures of every other scored
    candidate, trained on the rest (None: fewer than eight scored)."""
    if len(scored) < 8:
        return None
    train, held = list(scored[0::2]), list(scored[1::2])
    model = _regressor().fit([features(s, layers) for s, _ in train], [y for _, y in train])
    predicted = [float(v) for v in model.predict([features(s, layers) for s, _ in held])]
    return {"spearman": _spearman(predicted, [y for _, y in held]), "trained_on": len(train),
            "held_out": len(held)}


def _ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank from 1 (equal values share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0
