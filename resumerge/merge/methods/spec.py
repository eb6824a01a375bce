"""What a merge method is: a pure tensor function plus a declarative contract.

A method never touches files, dtype policy of the output, devices or global RNG state. The planner reads the
contract (:class:`MethodSpec`) to validate a config before any weight is read; the engine calls
:attr:`MethodSpec.fn` with a :class:`MergeContext` per output tensor (or per row chunk when the method is
``elementwise``, or through its :class:`RowStream` when it has one) and casts the result to ``out_dtype``
itself. A method that is not elementwise but has a :class:`RowStream` is defined by it alone: its ``fn`` is the
stream over the tensor as one chunk (:func:`one_chunk`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from resumerge.machine.torch_import import dtype_name, torch
from resumerge.merge.methods.footprint import MethodFootprint
from resumerge.merge.methods.resources import NO_RESOURCES, Resources


class Scope(enum.Enum):
    """Where a parameter's value lives and for which inputs it is resolved."""

    GLOBAL = "global"  # one value per output tensor, matched against the output tensor name
    PER_MODEL = "per_model"  # one value per input model (base included)
    NON_BASE = "non_base"  # one value per input model, never resolved for the base model


class BasePolicy(enum.Enum):
    """What a method does with ``base_model``."""

    REQUIRED = "required"  # the base must be one of the inputs
    OPTIONAL = "optional"  # used when given
    IGNORED = "ignored"  # accepted, but merged like any other input (e.g. linear)
    FORBIDDEN = "forbidden"  # a base is a config error


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a method.

    ``required`` parameters have no default; a missing value is a config error naming the YAML path.
    ``minimum``/``maximum`` bound numeric values inclusively (``exclusive_min`` makes the lower bound strict).
    """

    name: str
    scope: Scope
    kind: type = float
    default: Any = None
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_min: bool = False


@dataclass(frozen=True)
class InputsOnly:
    """A value a method computes from its inputs alone, never from a parameter (a task vector, its magnitude keys),
    declared on :attr:`MethodSpec.from_inputs`: ``compute(ctx, i)`` gives it for input ``i``, ``entry_bytes(itemsize)``
    what it holds per entry of the tensor for inputs of ``itemsize`` bytes. Where the engine merges the same inputs
    for several merges (a generation's candidates: :class:`~resumerge.merge.engine.unwritten.Population`), it is
    computed once for all of them (:meth:`MergeContext.from_inputs`); the same function computes it either way, so every
    merge gets the same bits as when it is merged alone."""

    name: str
    compute: Callable[[MergeContext, int], torch.Tensor]
    entry_bytes: Callable[[int], int]


class InputsMemo(Protocol):
    """Where the engine keeps the :class:`InputsOnly` values of one chunk's inputs for every merge of them."""

    def value(self, what: InputsOnly, index: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``what``'s value for input ``index``: kept from an earlier merge of the same inputs, else ``compute()``
        (then kept)."""
        ...


@dataclass(frozen=True)
class MergeContext:
    """Everything a method sees for one output tensor (or one row chunk of it).

    ``tensors`` are in config order and already cast to the compute dtype; ``base_index`` points into them (``None``
    without a base). ``model_params[i]`` holds the resolved per-model parameters of input ``i`` (none for the base
    when a parameter is ``NON_BASE``); ``params`` the global ones. Every parameter is there, unset ones at their
    default (the planner fills them with :meth:`MethodSpec.bind`), so a method reads ``params["name"]``.
    ``generator`` is seeded from (random seed, output tensor name) for randomised methods, so results do not depend
    on execution order.
    """

    tensors: Sequence[torch.Tensor]
    base_index: int | None
    model_params: Sequence[Mapping[str, Any]]
    params: Mapping[str, Any]
    generator: torch.Generator | None = None
    # True when every access to ``tensors`` returns a buffer of the method's own, which it may overwrite (the
    # engine's lazily read inputs, see MethodSpec.lazy_inputs); False: they are the caller's, never to be written.
    owned_inputs: bool = False
    # With lazily read inputs: ``read_rows(i, first, stop)`` reads rows ``[first, stop)`` of input ``i`` alone (as
    # ``tensors[i]`` would read the whole, cast alike), so a method can consume an input chunk by chunk; None
    # where the inputs are already in memory.
    read_rows: Callable[[int, int, int], torch.Tensor] | None = None
    # The run's shared objects (MoE routers, an extraction's factor pairs): per run, never module globals.
    resources: Resources = NO_RESOURCES
    # Where the engine lends the buffers it reuses from one tensor to the next, by use (``lend(use, shape, dtype)``):
    # see result_buffer.
    lend: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    # Where the values the method declares from its inputs alone are shared with other merges of the same inputs
    # (see from_inputs); None: each is computed for this merge alone.
    memo: InputsMemo | None = None

    def from_inputs(self, what: InputsOnly, index: int) -> torch.Tensor:
        """``what.compute(self, index)`` (a value the method declares on :attr:`MethodSpec.from_inputs`): with a
        ``memo``, computed once for every merge of these inputs and shared, so the caller never writes it."""
        if self.memo is None:
            return what.compute(self, index)
        return self.memo.value(what, index, lambda: what.compute(self, index))

    @property
    def base(self) -> torch.Tensor:
        """The base tensor; raises ``ValueError`` when the method was called without one."""
        if self.base_index is None:
            raise ValueError("this merge needs a base tensor")
        return self.tensors[self.base_index]

    def result_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      use: str = "result") -> torch.Tensor:
        """An uninitialised contiguous tensor for the method's result (its accumulator): on the CPU, the buffer the
        engine lends for results when it lends one (reused across tensors, so no fresh pages to fault in), else a
        fresh tensor. One per ``use`` and call of the method: a second call for the same use returns the same
        buffer again (``"cast"``: a second buffer, where an accumulator is cast to the result's dtype). The method
        may return it; the engine copies out what it keeps."""
        if self.lend is not None and device.type == "cpu":
            return self.lend(use, shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def others(self) -> list[int]:
        """Indices of the non-base inputs, in config order."""
        return [i for i in range(len(self.tensors)) if i != self.base_index]


MergeFn = Callable[[MergeContext], "torch.Tensor"]


class RowStream(Protocol):
    """One output tensor of a method that is not elementwise, computed from row chunks of its inputs.

    The engine asks :meth:`wants` for ``k = 0, 1, ...`` (each once, in order) and, while it says yes, calls
    :meth:`observe` with a :class:`MergeContext` of every row chunk, first rows first (statistics pass ``k``);
    then it calls :meth:`apply` with every chunk again, first rows first, and each call returns that chunk's output
    rows — together the very bits :attr:`MethodSpec.fn` returns for the whole tensor. The chunks of different
    passes may be cut differently; a chunk's context is what the whole tensor's would hold, restricted to rows.
    """

    # True when computing the tensor whole is faster, so the engine streams it only when it does not fit whole.
    prefer_whole: bool

    def wants(self, pass_index: int) -> bool:
        """Whether statistics pass ``pass_index`` must run before the output pass."""
        ...

    def observe(self, pass_index: int, ctx: MergeContext) -> None:
        """Take one chunk's statistics in pass ``pass_index``."""
        ...

    def apply(self, ctx: MergeContext) -> torch.Tensor:
        """The output rows of the next chunk."""
        ...

    def held_bytes(self) -> int:
        """Bytes the stream keeps from its first chunk to its last, beyond each chunk's own buffers (the memory
        governor reserves them for the whole tensor's passes)."""
        ...


class RowStreamFactory(Protocol):
    """Returns a fresh :class:`RowStream` for one output tensor. Arguments are those of :class:`MergeContext`,
    with the tensors' ``shape`` instead of the tensors, and the name of the dtype the method will see them in
    (``"float32"``, ``"bfloat16"``…; None: not known yet). A name, not a torch dtype: the planner builds streams
    to size a run's memory before torch is imported (:mod:`resumerge.machine.torch_import`).

    With ``whole`` the stream will see the tensor as one chunk (:func:`one_chunk`): it always exists, and it
    takes from that chunk in its output pass what a statistics pass would have to gather (no pass reads the
    inputs twice). Without, None says this tensor cannot be cut into row chunks (then it is computed whole)."""

    def __call__(self, shape: tuple[int, ...], base_index: int | None, model_params: Sequence[Mapping[str, Any]],
                 params: Mapping[str, Any], *, dtype: str | None = None,
                 whole: bool = False) -> RowStream | None: ...


def one_chunk(streamed: RowStreamFactory) -> MergeFn:
    """The whole-tensor function of a method defined by its row stream: the stream (built ``whole``) run over the
    context as its one chunk — its statistics passes, if it still asks for any, then its output pass."""

    def merge(ctx: MergeContext) -> torch.Tensor:
        first = ctx.tensors[ctx.base_index if ctx.base_index is not None else 0]
        stream = streamed(tuple(first.shape), ctx.base_index, ctx.model_params, ctx.params,
                          dtype=dtype_name(first.dtype), whole=True)
        if stream is None:
            raise ValueError("internal: a stream built whole must exist")
        pass_index = 0
        while stream.wants(pass_index):
            stream.observe(pass_index, ctx)
            pass_index += 1
        return stream.apply(ctx)

    return merge
@dataclass(frozen=True)
class RowSelection:
    """How a method that is not elementwise merges only some rows of a tensor, each the same bits as the same row
    of its whole merge: ``exact(params, model_params)`` says whether that holds for a tensor's resolved parameters
    (a statistic it cannot take from what is shared of the whole tensor, say a rescale's norms: False, and the
    tensor is merged whole); ``merge(ctx, rows)`` is given the whole tensor's context (its statistics taken from all
    of it: the values declared on :attr:`MethodSpec.from_inputs`) and ``rows`` (int64, ascending, distinct) and
    returns those output rows. An elementwise method needs none: its row chunks are merged alone by definition."""

    exact: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], bool]
    merge: Callable[[MergeContext, torch.Tensor], torch.Tensor]


# Returns a one-sentence problem description, or None when the resolved parameters are acceptable.
ContractCheck = Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], "str | None"]


@dataclass(frozen=True)
class WholeCost:
    """How a method's compute time is estimated when it does not follow its output's elements (a decomposition: a
    truncated SVD costs by the matrix it factors, not by its rank-r result): ``plan`` times one call on synthetic
    inputs of the real shapes per class of input shapes and values of ``params``, and ``shared_by`` consecutive
    tensors of the plan (a LoRA module's A and B) come from one computation, whose time and reads count once."""

    params: tuple[str, ...] = ()
    shared_by: int = 1
    # What its time is bound by, as ``plan`` says it beside the timing (the SVD methods: "SVD-bound, ...").
    bound: str = ""


@dataclass(frozen=True)
class ScaledProbe:
    """How ``plan`` times a unit whose work is neither its output's rows nor its inputs' shapes alone (a transplant:
    its tables read and copied, then as many approximations as it has tokens to approximate): the unit called on its
    real inputs with ``small`` and with ``large`` in place of the run's resources, its time taken as
    ``small + (large - small) * scale``. ``what`` says the reduced scale (``16 of 82 approximated tokens``)."""

    small: Resources
    large: Resources
    scale: float
    what: str


@dataclass(frozen=True)
class MethodSpec:
    """A merge method (or a kind's own unit function): its pure function and the contract the planner checks up
    front.

    ``min_inputs``/``max_inputs`` count every input of a tensor, the base included; ``min_non_base``/
    ``max_non_base`` (when set) count the inputs other than the base. ``elementwise`` methods give
    the same result when applied to row chunks independently, so the engine may stream large tensors through
    them; ``streamed`` ones give it from row chunks in several passes (:class:`RowStream`); others need the whole
    tensor at once. ``randomized`` methods receive a generator. ``footprint`` is the method's measured working
    memory (see :mod:`resumerge.merge.methods.footprint`), which :func:`declared` requires.
    """

    name: str
    fn: MergeFn
    params: tuple[ParamSpec, ...] = ()
    base: BasePolicy = BasePolicy.IGNORED
    min_inputs: int = 1
    max_inputs: int | None = None
    elementwise: bool = False
    randomized: bool = False
    # What the output's model card says of the method: its display name (the name when empty), a one-line
    # description, and a link (none when empty).
    title: str = ""
    summary: str = ""
    reference: str = ""
    check: ContractCheck | None = None
    # A method that is not elementwise but can still run on row chunks, in several passes (see RowStream).
    streamed: RowStreamFactory | None = None
    # True when the method returns float32 for float16/bfloat16 inputs (as mergekit's does); without out_dtype
    # the output is then saved as float32, like mergekit saves it.
    half_result_float32: bool = False
    min_non_base: int | None = None
    max_non_base: int | None = None
    # The working memory the method allocates per element, by dtype, and its scratch rule, declared beside its
    # function (see resumerge.merge.methods.footprint); the planner and the memory governor admit its units by it.
    # Required: declared() refuses a method without one, so no method is ever admitted by a guess.
    footprint: MethodFootprint | None = None
    # True when the output's bytes depend on torch's thread count (a whole-tensor sum torch splits over its
    # threads): the run's -j/--num-threads is then recorded with the plan, reused on resume and a different one
    # refused. False keeps -j out of the plan's fingerprint.
    thread_dependent: bool = False
    # True when the method may not need its inputs at all (LoRA extraction's factors: the sibling unit of a module
    # may have computed them already): the engine then reads each input only when the method indexes ``tensors``,
    # and again at each access, so a method keeps what it needs and drops the rest early; its inputs but the largest
    # are taken a row chunk at a time (MergeContext.read_rows), and its units are estimated so.
    lazy_inputs: bool = False
    # The parameter in which a unit that reads its inputs itself, by row ranges, states the bytes it holds (figured
    # by its planner, which knows what it keeps: a transplant's shared rows and batch workspace, never its whole
    # inputs); the engine and ``plan`` admit its units by that figure. None: the footprint's rule.
    held_param: str | None = None
    # How ``plan`` times the method when its cost does not follow its output's elements (None: it does).
    whole_cost: WholeCost | None = None
    # How ``plan`` times a unit on its real inputs at a reduced scale (None: by whole_cost, else by rows): given the
    # run's resources and the unit's parameters, the two reduced runs and how they scale (see ScaledProbe).
    scaled_probe: Callable[[Resources, Mapping[str, Any]], ScaledProbe] | None = None
    # Values that replace declared defaults on the vocabulary tensors (the token embedding and the output head) where
    # the config sets none for them: the SVD methods merge those by their mean path unless asked otherwise, as
    # mergekit's port of them does (an SVD of a 128k-row head holds tens of GB). Read by the planner only.
    vocab_defaults: tuple[tuple[str, Any], ...] = ()
    # Entries per row chunk in which an elementwise method's tensors larger than that are always streamed to the
    # writer, whatever the budget (LoRA extraction's tensors saved whole: none is ever whole in memory); None:
    # row chunks only when a tensor would take more than a quarter of the budget.
    row_chunk: int | None = None
    # True when the method merges LoRA adapters through their factors (``core_space``): the planner then gives each
    # adapted tensor the base followed by every adapter's A and B factor, not the dense adapted weights (see
    # resumerge.merge.plan.lorafactors), and refuses parents that are not adapters of the base.
    factor_inputs: bool = False
    # True when the method merges linear weights with their inputs' Gram matrices (``regmean``): the planner then
    # gives each such weight, after the weights, every model's measured Gram from the folder its global ``grams``
    # parameter names (see resumerge.merge.plan.grams), each marked by a per-model parameter.
    gram_inputs: bool = False
    # The values the method computes from its inputs alone (InputsOnly): the engine may compute each once for every
    # merge of the same inputs (a generation's candidates) and hand it to each (MergeContext.from_inputs).
    from_inputs: tuple[InputsOnly, ...] = ()
    # How the method merges some rows of a tensor alone, exactly (a generation's candidates merge only the rows of
    # the input embeddings their texts read); None: only whole (or in row chunks, when elementwise).
    rows: RowSelection | None = None

    def param(self, name: str) -> ParamSpec | None:
        """Return the spec of parameter ``name``, or None if the method has no such parameter."""
        for spec in self.params:
            if spec.name == name:
                return spec
        return None

    def bind(self, model_params: Sequence[Mapping[str, Any]], params: Mapping[str, Any], base_index: int | None
             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """``model_params`` and ``params`` with every parameter the caller left out set to its default: global ones
        once, per-model ones for every input (``NON_BASE`` ones for every input but the base). The planner fills a
        plan's parameters through it, and method bodies read their parameters by name and rely on this. A required
        parameter left out stays out (the planner refuses it before any method runs)."""
        bound = {s.name: s.default for s in self.params if s.scope is Scope.GLOBAL and not s.required}
        bound.update(params)
        per_model = []
        for i, own in enumerate(model_params):
            defaults = {s.name: s.default for s in self.params if not s.required and (
                s.scope is Scope.PER_MODEL or (s.scope is Scope.NON_BASE and i != base_index))}
            per_model.append(defaults | dict(own))
        return per_model, bound


def declared(*specs: MethodSpec) -> tuple[MethodSpec, ...]:
    """``specs`` as one declaration (the built-in methods, a kind's own units), checked: a name is declared once,
    and every method declares its footprint, so no method is ever admitted by a guess."""
    names = [spec.name for spec in specs]
    for spec in specs:
        if names.count(spec.name) > 1:
            raise ValueError(f"merge method {spec.name!r} is declared twice")
        if spec.footprint is None:
            raise ValueError(f"merge method {spec.name!r} declares no footprint: measure it with "
                             "bench/method_footprint.py --fit and pass footprint=measured(...)")
    return specs
