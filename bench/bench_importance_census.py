"""The importance pass's sums (``run --imatrix-texts``) against transformers' own over the whole census
(tests/census.py): per family, a tiny model, the pass run on it as ``run`` runs it (its sums kept by checkpoint
module name: tests/importance_oracle.py) and transformers' forward of it over the same ids, hooked before every
``nn.Linear``; the largest difference of a dense linear's sums relative to its largest sum, or what stopped the pass.
tests/test_importance_entered.py holds a representative set of these in the suite.

Usage::

    PYTHONPATH=$PWD python bench/bench_importance_census.py [FAMILY ...] [--work DIR]

Prints one markdown row a family (whether ``run --imatrix-texts`` accepts it: it names the weights as a GGUF does)
and a summary line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def row(family: str, work: Path) -> tuple[str, float | None]:
    """One family's row and its largest relative difference (None where the pass or transformers stopped)."""
    from census import make_census_model, texts_of
    from importance_oracle import differences, hooked_sums, pass_found, unsummed

    from resumerge.forward.sums.imatrix import ARCH_OF

    accepts = "yes" if family in ARCH_OF else "no"
    model = make_census_model(work / family / "model", family, 1)
    texts = texts_of(family)
    try:
        sums = pass_found(model, texts, work / family / "state")[0]
    except Exception as error:  # the census's news: one line, the rest still run
        first = str(error).splitlines()[0][:90] if str(error) else ""
        return f"| {family} | {accepts} | pass stopped: {type(error).__name__}: {first} |", None
    try:
        hooked = hooked_sums(model, texts)
    except Exception as error:  # transformers' own failure, not the pass's
        return f"| {family} | {accepts} | reference crash: {type(error).__name__} |", None
    dense = {name: value for name, value in sums.items() if value.dim() == 1}
    missing = unsummed(hooked, dense)
    outside = len(set(hooked) - set(dense)) - len(missing)
    worst = max(differences(dense, hooked).values(), default=0.0)
    said = (f"{worst:.1e} over {len(dense)} linears" + (f" ({outside} outside the layers)" if outside else "")
            + (f", {len(missing)} not summed: {missing[:3]}" if missing else ""))
    return f"| {family} | {accepts} | {said} |", worst if not missing else None


def main() -> None:
    from census import CENSUS
    from transformers.utils import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="census families (default: all)")
    parser.add_argument("--work", type=Path, default=None, help="where the models and passes go (default: a tmp dir)")
    args = parser.parse_args()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    warnings.simplefilter("ignore")
    work = args.work or Path(tempfile.mkdtemp(prefix="importance-census-"))
    started = time.perf_counter()
    worst: list[float] = []
    stopped = 0
    print("| family | run --imatrix-texts accepts | pass's sums against transformers' |\n|---|---|---|", flush=True)
    for family in args.families or CENSUS:
        line, found = row(family, work)
        print(line, flush=True)
        if found is None:
            stopped += 1
        else:
            worst.append(found)
    print(f"\n{len(worst)} families agree to {max(worst, default=0.0):.1e} (relative), {stopped} did not run or "
          f"left linears unsummed; {time.perf_counter() - started:.0f} s wall")


if __name__ == "__main__":
    main()
