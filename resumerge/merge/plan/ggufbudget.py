"""``--gguf-target-size SIZE`` / ``--gguf-target-bpw X``: each decoder-layer matrix's GGUF type chosen to make the
smallest predicted loss within the size, from the costs the importance pass measured
(:mod:`resumerge.outputs.gguf.sensitivity`); every other tensor (the embeddings, the head, norms) as the
``--gguf-type`` mix writes it.

The choice is a multiple-choice knapsack: each tensor one of its candidate types, the sum of their costs least with
their bytes within the budget (:func:`choose`). Solved greedily on each tensor's lower convex hull of (bytes,
cost) — the upgrade that buys the most cost per byte first, while it fits — then any single upgrade that still fits,
the largest gain first. Ties go by tensor name, then the type's bytes: the same costs give the same choice, so a
resumed run writes the same file. The choice is the plan's (``PlanOptions.gguf_chosen_types``: ``NAME=type``
pairs, :func:`chosen_pairs`), recorded with the run.

The budget: SIZE is the whole file (header, every tensor padded to the alignment; the header does not change with
the types); X bits per weight counts tensor bytes over every tensor's values, as the plan's notes do.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resumerge.inputs.gguf.ggmltypes import TYPES
from resumerge.merge.plan.merge_plan import PlanOptions, TensorPlan
from resumerge.outputs.gguf.layout import pad
from resumerge.outputs.gguf.outcodec import GgufOutCodec
from resumerge.outputs.gguf.sensitivity import candidate_types, type_bytes

# The matrices of a decoder layer a target chooses the type of (llama.cpp's tensor categories).
_CHOSEN = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_up|ffn_gate|ffn_down)\.weight$")


@dataclass(frozen=True)
class Option:
    """One type a tensor may be stored as: its ggml type, the bytes it counts against the budget, its cost."""

    ggml_type: int
    nbytes: int
    cost: float


@dataclass(frozen=True)
class Target:
    """A size target: the whole file's bytes (``size``), or bits per weight over every tensor (``bpw``)."""

    size: int | None = None
    bpw: float | None = None

    def describe(self) -> str:
        from resumerge.machine.memory.sizes import format_size

        return (f"--gguf-target-size {format_size(self.size)}" if self.size is not None
                else f"--gguf-target-bpw {self.bpw}")


@dataclass(frozen=True)
class Budgeting:
    """A GGUF plan as a target sees it: the tensors it chooses (GGUF name -> row-major shape), the bytes that stay
    whatever it chooses (``fixed``: the file's, or for bits per weight the other tensors'), and ``budget``: the
    bytes the chosen tensors may take together (negative where even the fixed ones exceed the target)."""

    shapes: Mapping[str, tuple[int, ...]]
    fixed: int
    budget: int
    padded: bool

    def option_bytes(self, ggml_type: int, name: str) -> int:
        nbytes = type_bytes(ggml_type, self.shapes[name])
        return pad(nbytes) if self.padded else nbytes

    def smallest(self) -> int:
        """The least the chosen tensors can take (each its smallest candidate)."""
        return sum(min(self.option_bytes(t, n) for t in candidate_types(s[-1])) for n, s in self.shapes.items())


def chosen_tensor(name: str, shape: Sequence[int]) -> bool:
    """Whether a target chooses the type of GGUF tensor ``name`` of (row-major) ``shape``: a decoder layer's
    attention or feed-forward matrix whose rows are whole blocks of some candidate type."""
    return len(shape) == 2 and _CHOSEN.match(name) is not None and bool(candidate_types(int(shape[-1])))


def budgeting(tensors: Mapping[str, TensorPlan], file_size: int, target: Target) -> Budgeting:
    """What ``target`` leaves for the chosen tensors of a one-file GGUF plan of ``tensors`` laid out in
    ``file_size`` bytes."""
    shapes: dict[str, tuple[int, ...]] = {}
    chosen_now = values = stored = 0
    for tp in tensors.values():
        codec = tp.out_codec
        values += math.prod(tp.shape)
        stored += tp.nbytes
        if isinstance(codec, GgufOutCodec) and chosen_tensor(codec.gguf_name, tp.shape):
            shapes[codec.gguf_name] = tuple(tp.shape)
            chosen_now += pad(tp.nbytes) if target.size is not None else tp.nbytes
    if target.size is not None:
        fixed = file_size - chosen_now
        return Budgeting(shapes, fixed, target.size - fixed, True)
    assert target.bpw is not None
    fixed = stored - chosen_now
    return Budgeting(shapes, fixed, math.floor(target.bpw * values / 8) - fixed, False)


def choose(options: Mapping[str, Sequence[Option]], budget: int) -> dict[str, int] | None:
    """Each tensor's type (of its ``options``) making the least total cost with the bytes within ``budget``; None
    where each tensor's smallest option together exceed it."""
    hulls = {name: _hull(found) for name, found in sorted(options.items())}
    at = dict.fromkeys(hulls, 0)
    spent = sum(hull[0].nbytes for hull in hulls.values())
    if spent > budget:
        return None
    # The hull's next step of each tensor, the most cost saved per byte first (ties: by name).
    steps: list[tuple[float, str]] = [(-_slope(hull, 0), name) for name, hull in hulls.items() if len(hull) > 1]
    heapq.heapify(steps)
    while steps:
        _, name = heapq.heappop(steps)
        hull, i = hulls[name], at[name]
        more = hull[i + 1].nbytes - hull[i].nbytes
        if spent + more > budget:
            continue  # its later steps are larger still
        spent += more
        at[name] = i + 1
        if i + 2 < len(hull):
            heapq.heappush(steps, (-_slope(hull, i + 1), name))
    picked = {name: hulls[name][i] for name, i in at.items()}
    # What the hull's steps left: any single change that still fits and lowers the cost, the largest gain first.
    while True:
        best: tuple[float, int, str, Option] | None = None
        for name in sorted(picked):
            now = picked[name]
            for option in options[name]:
                gain = now.cost - option.cost
                if gain > 0 and spent + option.nbytes - now.nbytes <= budget:
                    key = (-gain, option.nbytes, name, option)
                    if best is None or key[:3] < best[:3]:
                        best = key
        if best is None:
            break
        _, _, name, option = best
        spent += option.nbytes - picked[name].nbytes
        picked[name] = option
    return {name: option.ggml_type for name, option in picked.items()}


def _hull(options: Sequence[Option]) -> list[Option]:
    """The lower convex hull of ``options`` by (bytes, cost): the smallest first, each next one saving cost at a
    falling rate per byte (an option costing more than a smaller one never on it)."""
    ordered = sorted(options, key=lambda o: (o.nbytes, o.cost, o.ggml_type))
    frontier: list[Option] = []
    for option in ordered:
        if frontier and option.cost >= frontier[-1].cost:
            continue  # no cheaper than a smaller one
        frontier.append(option)
    hull: list[Option] = []
    for option in frontier:
        while len(hull) >= 2 and _slope(hull, len(hull) - 2) <= _rate(hull[-1], option):
            hull.pop()  # the middle one saves less per byte than going on past it
        hull.append(option)
    return hull


def _rate(a: Option, b: Option) -> float:
    return (a.cost - b.cost) / (b.nbytes - a.nbytes)


def _slope(hull: Sequence[Option], i: int) -> float:
    """The cost saved per byte going from the hull's ``i``-th option to the next."""
    return _rate(hull[i], hull[i + 1])


def chosen_pairs(choice: Mapping[str, int]) -> tuple[str, ...]:
    """``choice`` (GGUF name -> ggml type) as the plan records it: ``NAME=type`` pairs, by name."""
    return tuple(f"{name}={TYPES[kind].name.lower()}" for name, kind in sorted(choice.items()))


def chosen_patterns(pairs: Sequence[str]) -> tuple[str, ...]:
    """The recorded ``NAME=type`` pairs as ``--gguf-tensor-type`` pairs matching each name alone."""
    return tuple(f"^{re.escape(name)}$={kind}" for name, _, kind in (p.partition("=") for p in pairs))


def check_target(tensors: Mapping[str, TensorPlan], file_size: int, gguf_type: str, target: Target,
                 chosen: Sequence[str]) -> None:
    """Refuse (ModelInputError, exit 2, while planning: before any work) a ``target`` below the smallest file a
    GGUF plan of ``tensors`` in ``file_size`` bytes can be (each chosen tensor at its smallest type, the rest as
    the ``gguf_type`` mix writes them); with the types ``chosen``, an internal error where they do not fit it."""
    from resumerge.errors import ModelInputError, ResumergeError
    from resumerge.machine.memory.sizes import format_size

    found = budgeting(tensors, file_size, target)
    if chosen:
        if found.budget < 0:
            raise ResumergeError(f"internal: the types chosen for {target.describe()} exceed it")
        return
    least = found.smallest()
    if least <= found.budget:
        return
    values = sum(math.prod(tp.shape) for tp in tensors.values())
    smallest = (format_size(found.fixed + least) if target.size is not None
                else f"{8 * (found.fixed + least) / max(values, 1):.3f} bits per weight")
    raise ModelInputError(f"{target.describe()}: below the smallest this merge's GGUF can be, {smallest} (each "
                          f"decoder layer's matrix at its smallest type, the rest as --gguf-type {gguf_type} writes "
                          "them)", hint=f"give a target of at least {smallest}, or a smaller --gguf-type")


def target_notes(options: PlanOptions) -> list[str]:
    """What a plan with a size target says of it: the types it chose (by type, how many), or that they are chosen
    once the importance pass has measured their costs."""
    target = Target(options.gguf_target_size, options.gguf_target_bpw)
    if target.size is None and target.bpw is None:
        return []
    if not options.gguf_chosen_types:
        return [f"the decoder layers' matrices' GGUF types are chosen for {target.describe()} once the importance "
                "pass has measured what each candidate type costs each of them (the plan is then recorded again, "
                "with them)"]
    counts: dict[str, int] = {}
    for pair in options.gguf_chosen_types:
        kind = pair.partition("=")[2].upper()
        counts[kind] = counts.get(kind, 0) + 1
    told = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda c: (-c[1], c[0])))
    return [f"GGUF types chosen for {target.describe()} by what each costs the merge on the --imatrix-texts texts "
            f"(measured in the importance pass): the decoder layers' {len(options.gguf_chosen_types)} matrices as "
            f"{told}"]


def choose_for(tensors: Mapping[str, TensorPlan], file_size: int, target: Target,
               costs: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
    """The types ``target`` chooses for a one-file GGUF plan of ``tensors`` in ``file_size`` bytes by ``costs``
    (GGUF name -> type name -> cost, as the importance pass wrote them); an internal error where a chosen tensor
    was not measured or nothing fits (the planner refused such a target already)."""
    from resumerge.errors import ResumergeError
    from resumerge.merge.plan.gguftypes import OVERRIDE_TYPES

    found = budgeting(tensors, file_size, target)
    options: dict[str, list[Option]] = {}
    for name in found.shapes:
        measured = costs.get(name)
        if measured is None:
            raise ResumergeError(f"internal: the importance pass measured no cost for {name}")
        kinds = [(OVERRIDE_TYPES[kind.lower()], cost) for kind, cost in sorted(measured.items())]
        options[name] = [Option(kind, found.option_bytes(kind, name), cost) for kind, cost in kinds]
    choice = choose(options, found.budget)
    if choice is None:
        raise ResumergeError(f"internal: nothing fits {target.describe()}")
    return choice
