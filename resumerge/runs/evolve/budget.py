"""What a generation's streamed pass holds, judged before any weight is read: the inputs' layer that holds most
(kept for every candidate), one candidate's layer, and every model's hidden states (the candidates' and a kl
task's parent's) for the task whose texts are longest. Past ``--max-memory`` the search is refused in one line
naming the largest popsize that fits, or the budget this popsize needs.

:func:`pass_steps` gives what each step of the pass itself holds (its admission by the RAM governor, and the
budget it is judged by once its models are opened)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import UsageError
from resumerge.forward.compared.passes import padded_positions
from resumerge.forward.text.texts import context_of, load_tokenizer, sequences
from resumerge.machine.memory.sizes import format_size
from resumerge.runs.evolve.spec import EvolveSpec

if TYPE_CHECKING:
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.merge.engine.unwritten import Population
    from resumerge.runs.evolve.generation import TaskTexts

# (popsize, hidden bytes per model) -> the bytes a generation's pass holds; and (budget, hidden bytes) -> the
# largest popsize that fits (the engine's generation_bytes and largest_popsize over the first candidate's plan).
Holds = Callable[[int, int], int]
Largest = Callable[[int, int], int]


def hidden_bytes(spec: EvolveSpec, tokenizer: Path, config: dict[str, Any]) -> int:
    """The hidden states one model holds in the pass of the task with the most padded positions (float32)."""
    width = (config.get("text_config") or config).get("hidden_size") or config.get("hidden_size") or 0
    context = context_of([(str(tokenizer), config)], cut=True)
    # plain: read without transformers where it would load the same tokenizer (only texts are encoded here, as the
    # objectives' own texts are: check's cached_sequences), so a search imports transformers only for lm-eval tasks
    reader = load_tokenizer([tokenizer], what="resumerge evolve", plain=True)
    positions = max((padded_positions(sequences(reader, Path(t.texts), context, option=f"{t.name}'s texts"))
                     for t in spec.tasks if t.texts is not None), default=0)
    return int(positions) * int(width) * 4


def refuse_past_budget(spec: EvolveSpec, popsize: int, hidden: int, budget: int, holds: Holds,
                       largest: Largest) -> None:
    """Raise :class:`UsageError` (exit 2) where a generation of ``popsize`` candidates (and a kl task's parent
    beside them) holds more than ``budget`` bytes in its pass."""
    beside = 1 if any(t.kind == "kl" for t in spec.tasks) else 0
    need = holds(popsize + beside, hidden)
    if need <= budget:
        return
    fits = largest(budget, hidden) - beside
    hint = f"give --popsize {fits} (the largest that fits) or --max-memory {format_size(need, compact=True)}" \
        if fits >= 2 else f"give --max-memory {format_size(need, compact=True)} or more"
    raise UsageError(f"a generation of {popsize} candidates holds about {format_size(need)} in its streamed pass, "
                     f"past --max-memory {format_size(budget)}", hint=hint)


def pass_steps(population: Population, candidates: Sequence[ModelStream], parents: Sequence[ModelStream],
               texts: Sequence[TaskTexts]) -> tuple[dict[str, int], int]:
    """What each step of a generation's pass (:mod:`.generation`) holds, by its name, and every model's hidden
    states (in and out of a layer): ``candidate``, the inputs' largest layer read once for all, one candidate's
    layer and its largest tensor's merge, with what is kept for every candidate where that is enabled
    (:meth:`~resumerge.merge.engine.unwritten.Population.holds`); ``heads``, that and
    one candidate's head step (as check's); ``parent`` and ``parent heads``, a kl task's parent's largest layer and
    head step. Reads no weight."""
    from resumerge.forward.compared.needs import step_bytes

    merge = population.holds(popsize=1, hidden_bytes=0)  # as the pass holds it: shared where that is enabled
    own = step_bytes(candidates[:1], [s for t in texts for s in t.sequences])
    steps = {"candidate": merge, "heads": merge + own.heads[0], "parent": 0, "parent heads": 0}
    states = 2 * len(candidates) * own.states
    for p, stream in enumerate(parents):
        theirs = step_bytes([stream], [s for t in texts if t.parent == p for s in t.sequences])
        steps["parent"] = max(steps["parent"], theirs.layers[0])
        steps["parent heads"] = max(steps["parent heads"], theirs.heads[0])
        states += 2 * theirs.states
    return steps, states
