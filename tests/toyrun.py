"""``python -m resumerge`` with the toy format of ``toycodec`` plugged into the run's codec table: the kill tests of
outputs in a stored format run it in a process of their own, as the CLI."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from toycodec import TOY

from resumerge.cli.commands import main
from resumerge.merge.engine import session
from resumerge.merge.plan.planner import build_plan

if __name__ == "__main__":
    session.build_plan = partial(build_plan, codecs=TOY)  # type: ignore[assignment]
    sys.exit(main(sys.argv[1:]))
