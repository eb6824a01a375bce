"""The rule that says whether the prompt forward pass fits the share of the memory budget its process is given.

One rule for the run's guard (:mod:`.forward`, in the pass's process, before it reads a weight) and ``plan``'s
estimate (:mod:`.passcost`), so ``plan`` says "will not fit" exactly where the run would refuse, naming the same
smallest budget. Light: no torch, no transformers.
"""

from __future__ import annotations

from resumerge.errors import UsageError
from resumerge.machine.memory.budget import SAFETY_MARGIN, smallest_budget_for
from resumerge.machine.memory.sizes import format_size


def share_problem(child_held: int, layer_bytes: int, share: int, parent_held: int) -> UsageError | None:
    """The refusal of a pass whose process, holding ``child_held`` before its first layer and ``layer_bytes`` more
    at its largest, would not fit the ``share`` of the budget it is given (the run's process holding
    ``parent_held``); None when it fits. The refusal names the smallest budget under which it fits."""
    if child_held + layer_bytes <= share * (1 - SAFETY_MARGIN):
        return None
    # named with 1 % of the process's reading more, as budget_fitting names its budget: a rerun's pass process reads
    # a little differently, and the budget named must not be refused again for that (the admission test, under the
    # suite's load, once was)
    smallest = smallest_budget_for(layer_bytes, baseline_bytes=child_held + child_held // 100 + parent_held)
    return UsageError(f"the prompt forward pass needs {format_size(child_held + layer_bytes)} (its process holds "
                      f"{format_size(child_held)}, its largest layer {format_size(layer_bytes)}), more than the "
                      f"{format_size(share)} the budget leaves it",
                      hint=f"rerun with --max-memory {format_size(smallest, compact=True)} or more")
