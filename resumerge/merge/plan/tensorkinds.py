"""What an output tensor's plan takes from its kind, worked out for the first tensor of each kind and shared.

A tensor's kind is everything of its inputs but where they are stored (each input's codec, stored dtype, shape,
cast and first row, and its companions' parts, dtypes and shapes), with the method, the base's position and the
output vocabulary's rows (:func:`kind_key`); and, once its parameters are resolved, those parameters (the
instances a :class:`~resumerge.merge.plan.parameters.ParameterResolver` shares between the tensors of one key). Its
plan's shape, value and stored dtypes, stored format, size and whether it is a copy of one input follow from these
alone, never from a name or an offset, so the planner works them out once per kind (a DeepSeek-V3 plan of 46k
tensors has a few dozen kinds) and makes every other tensor of the kind from them (:meth:`Kind.plan`). An input
with a LoRA delta has no key: its tensor is planned on its own.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from resumerge.inputs.codecs import TensorEncoder
from resumerge.merge.plan.merge_plan import InputRef, TensorPlan

__all__ = ["KeyKinds", "Kind", "TensorKinds", "carried_companions", "kind_key"]

# Where an input is stored, left out of its kind; every other field is in it (a field added later too), but the
# companions, keyed on their parts, dtypes and shapes, and a LoRA delta, which has no key.
_WHERE = frozenset({"model", "file", "tensor", "start", "end"})
_ref_fields = attrgetter(*(f.name for f in fields(InputRef) if f.name not in _WHERE | {"lora", "companions"}))


def kind_key(method: str, base_index: int | None, vocab_rows: int | None,
             inputs: Sequence[InputRef]) -> Hashable | None:
    """The kind of an output tensor of ``method`` over ``inputs`` (the base at ``base_index``) with ``vocab_rows``
    rows of an aligned vocabulary (None: not aligned), before its parameters; None when an input has a LoRA
    delta."""
    key: list[Hashable] = [method, base_index, vocab_rows]
    for ref in inputs:
        if ref.lora is not None:
            return None
        companions = ref.companions
        key.append((_ref_fields(ref), tuple([(part, c.dtype, c.shape) for part, c in companions])
                    if companions else ()))
    return tuple(key)


def carried_companions(inputs: Sequence[InputRef], codec: TensorEncoder, *, copy_of: int | None = None,
                       base_index: int | None = None) -> tuple[tuple[str, InputRef], ...]:
    """The companions an output tensor over ``inputs`` stored in ``codec`` carries
    (:attr:`~resumerge.merge.plan.merge_plan.TensorPlan.carried`): those ``codec`` carries of the input it is a copy of
    (``copy_of``), else of its base (``base_index``), else of its first input. A companion the format carries (a
    static input_scale) is that input's: no merge recomputes it from weights."""
    index = copy_of if copy_of is not None else base_index if base_index is not None else 0
    return tuple((part, c) for part, c in inputs[index].companions if codec.carries(part))


# What a kind's tensors share: every field of their plans but these (a field added later too).
_OWN = ("name", "inputs", "carried")
_SHARED = tuple(f.name for f in fields(TensorPlan) if f.name not in _OWN)


@dataclass(frozen=True)
class Kind:
    """What every output tensor of one kind and one set of parameters has in its plan (``shared``, by field name):
    all of it but its name, its inputs and the companions it carries, each tensor's own from the input whose
    format it keeps (``carries``: whether its format carries any)."""

    shared: dict[str, Any]
    carries: bool

    @classmethod
    def of(cls, tp: TensorPlan) -> Kind:
        """The kind of ``tp``, a tensor planned whole (not yet placed in a shard, its experts not marked)."""
        return cls({name: getattr(tp, name) for name in _SHARED}, bool(tp.carried))

    def plan(self, name: str, inputs: tuple[InputRef, ...]) -> TensorPlan:
        """The plan of output tensor ``name`` of this kind over ``inputs``: the one the whole planning makes. The
        companions it carries follow :func:`carried_companions`."""
        carried: tuple[tuple[str, InputRef], ...] = ()
        if self.carries:
            shared = self.shared
            carried = carried_companions(inputs, shared["out_codec"], copy_of=shared["copy_of"],
                                         base_index=shared["base_index"])
        return TensorPlan(name=name, inputs=inputs, carried=carried, **self.shared)


class KeyKinds:
    """The tensors of one :func:`kind_key` in one plan build, once a tensor of it passed the shape checks: whether
    they are non-float (:attr:`nonfloat`: planned apart), and their :class:`Kind` per set of parameters."""

    def __init__(self, nonfloat: bool) -> None:
        self.nonfloat = nonfloat
        # By the parameters' instances: the kind holds them, so their ids stay theirs while it lives.
        self._kinds: dict[tuple[int, int], Kind] = {}

    def get(self, params: object, model_params: object) -> Kind | None:
        """The kind with these resolved parameters, if a tensor of it was planned."""
        return self._kinds.get((id(params), id(model_params)))

    def add(self, tp: TensorPlan) -> None:
        """Remember ``tp``'s kind, with its parameters."""
        self._kinds[(id(tp.params), id(tp.model_params))] = Kind.of(tp)


class TensorKinds:
    """The kinds of one plan build by :func:`kind_key` (:class:`KeyKinds`): one lookup of a key, whose hash is most of
    what finding a tensor's kind costs, for each of a plan's 46k tensors."""

    def __init__(self) -> None:
        self._keys: dict[Hashable, KeyKinds] = {}

    def get(self, key: Hashable) -> KeyKinds | None:
        """The kinds of ``key``, once a tensor of it passed its checks."""
        return self._keys.get(key)

    def checked(self, key: Hashable, nonfloat: bool) -> KeyKinds:
        """The kinds of ``key``, whose first tensor passed its checks and is ``nonfloat`` or not."""
        found = self._keys[key] = KeyKinds(nonfloat)
        return found
