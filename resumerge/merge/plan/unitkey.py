"""What a tensor's unit of work costs depends on, as a key: tensors of one class share their estimates.

A 92k-tensor plan holds a few dozen classes of tensors (every layer's ``q_a_proj`` has the same method, shapes,
dtypes and codecs): :func:`sizing_key` is everything of a :class:`~resumerge.merge.plan.merge_plan.TensorPlan` but where
its bytes are (its name, its shard, its inputs' files, tensor names and offsets, of which only the lengths are
kept), so two tensors with equal keys get equal answers from every estimate in
:mod:`resumerge.merge.plan.workunits`, which never read names or offsets. The key is exact, never a name pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import fields
from operator import attrgetter
from typing import TypeVar, cast

from resumerge.merge.plan.merge_plan import InputRef, LoraRef, TensorPlan

__all__ = ["TensorClasses", "sizing_key"]

T = TypeVar("T")

# Where the bytes are, left out of the key (a reference's length is kept), and the references, keyed on their own;
# every other field is in it, a field added later too.
_WHERE = frozenset({"name", "shard", "file", "tensor", "start", "end"})
_REFS = frozenset({"inputs", "carried", "lora", "companions"})
_plan_fields = attrgetter(*(f.name for f in fields(TensorPlan) if f.name not in _WHERE | _REFS))
_ref_fields = attrgetter(*(f.name for f in fields(InputRef) if f.name not in _WHERE | _REFS))
_lora_fields = attrgetter(*(f.name for f in fields(LoraRef) if f.name not in {"a", "b"}))


def sizing_key(tp: TensorPlan) -> Hashable:
    """Every field of ``tp`` but its name, its shard and where its inputs are stored (their lengths kept)."""
    return (_plan_fields(tp), tuple(map(_ref_key, tp.inputs)),
            tuple((part, _ref_key(ref)) for part, ref in tp.carried) if tp.carried else ())


def _ref_key(ref: InputRef) -> Hashable:
    return (_ref_fields(ref), ref.end - ref.start, None if ref.lora is None else _lora_key(ref.lora),
            tuple([(part, _ref_key(c)) for part, c in ref.companions]) if ref.companions else ())


def _lora_key(lora: LoraRef) -> Hashable:
    return _ref_key(lora.a), _ref_key(lora.b), _lora_fields(lora)


class TensorClasses:
    """The tensors of a plan sorted into classes by :func:`sizing_key`, once (hashing 92k nested keys is most of
    what sizing them costs): a question whose answer depends on nothing of a tensor but its key is then answered
    once per class (:meth:`per_class`), and a question asked of every tensor by its class number (:meth:`number`).
    A tensor whose key cannot be hashed (a parameter value that is a list) is a class of its own."""

    def __init__(self, tensors: Iterable[TensorPlan]) -> None:
        self._numbers: dict[str, int] = {}
        #: The first tensor of each class, by class number.
        self.members: list[TensorPlan] = []
        known: dict[Hashable, int] = {}
        for tp in tensors:
            try:
                number = known.setdefault(sizing_key(tp), len(self.members))
            except TypeError:
                number = len(self.members)
            if number == len(self.members):
                self.members.append(tp)
            self._numbers[tp.name] = number

    def number(self, tp: TensorPlan) -> int:
        """The class of ``tp``, one of the tensors sorted (found by its name)."""
        return self._numbers[tp.name]

    def per_class(self, answer: Callable[[TensorPlan], T]) -> Callable[[TensorPlan], T]:
        """``answer``, worked out once per class for the tensors sorted (found by their names): for a question
        whose answer depends on nothing of a tensor but its key (and on what ``answer`` itself holds fixed: a
        budget, a method table)."""
        answers: list[object] = [_MISSING] * len(self.members)
        numbers = self._numbers

        def memoised(tp: TensorPlan) -> T:
            number = numbers[tp.name]
            found = answers[number]
            if found is _MISSING:
                found = answers[number] = answer(tp)
            return cast(T, found)

        return memoised


_MISSING = object()  # an answer not worked out yet
