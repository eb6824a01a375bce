"""``python -m resumerge`` as though the whole model did not fit the budget: eval's generation runs one decoder layer
at a time (:mod:`resumerge.analyses.evaluation.streamgen`) on a tiny model, whose whole would fit any budget its
layers do; ``--spilled`` first: its KV cache spilled to the pass's folder too, and a step's batch of rows cut in
parts of 4 (as a plan does where every request's past at a layer would hold more than the layer). The kill tests
of the layer-streamed generation run it in a process of their own, as the CLI."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from resumerge.analyses.evaluation import run, streamgen
from resumerge.cli.commands import main


def streamed(spilled: bool) -> None:
    """The whole model judged not to fit (``spilled``: nor the KV cache beside the largest step, nor a step's rows
    in one batch)."""
    run._fits = lambda stream, settings: False  # type: ignore[assignment]
    if spilled:
        planned = streamgen.gen_plan

        def spilling(*args: Any, **kwargs: Any) -> Any:
            return replace(planned(*args, **kwargs), held=False, rows=4)  # and a step's batch cut in parts

        streamgen.gen_plan = spilling  # type: ignore[assignment]


if __name__ == "__main__":
    spill = sys.argv[1:2] == ["--spilled"]
    streamed(spill)
    sys.exit(main(sys.argv[2 if spill else 1:]))
