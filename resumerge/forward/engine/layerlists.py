"""Where a model keeps its decoder layers: one list of them (the base model's ``layers``, OPT's ``decoder.layers``), or
several lists the forward calls in turn (HRM's two stacks, ``L_module.layers`` and ``H_module.layers``, each run
several times a forward: :mod:`.calls` follows the order of the calls), seen by the pass as one sequence of layers
(:class:`Lists`), or each layer's parts in lists of their own (XLM's: :class:`Parts`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.machine.torch_import import torch


class Lists:
    """Several lists of decoder layers as one sequence (the first list's layers, then the next's): a layer read,
    or replaced in its own list (a capture's stand-ins), by its index in the sequence."""

    def __init__(self, lists: Sequence[Any]) -> None:
        self.lists = tuple(lists)
        self._at = [(list_, i) for list_ in self.lists for i in range(len(list_))]

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, index: int) -> Any:
        list_, i = self._at[index]
        return list_[i]

    def __setitem__(self, index: int, module: Any) -> None:
        list_, i = self._at[index]
        list_[i] = module

    def __iter__(self) -> Iterator[Any]:
        return (list_[i] for list_, i in self._at)


class Parts(Lists):
    """The parts of each decoder layer, each part in a list of its own (XLM's ``attentions``, ``layer_norm1``,
    ``ffns``, ``layer_norm2``: its forward's loop body calls layer ``i``'s parts in turn, with residual sums and its
    padding mask between them): no module runs a layer whole, so each part is a step of the pass, in the forward's
    order of calls (:mod:`.calls`), what the forward computes between two parts computed again from the pass's
    outputs (:mod:`.handed`), as it is between layers, and each part's output taken in its own shape (the attention's
    a tuple, a norm's a tensor: :data:`~.standins.AS_BUILT`)."""


def innermost(stack: Any) -> Any:
    """The list of ``stack`` the forward's last layer call is in, for what the forward applies after the layers (the
    last list's: HRM's high-level stack's final norm); the list itself where it is one."""
    return stack.lists[-1] if isinstance(stack, Lists) else stack


def first_list(stack: Any) -> Any:
    """The first list of ``stack`` (its layers' sizes and checkpoint prefix stand for every list's: HRM's two stacks
    hold the same layers); the list itself where it is one."""
    return stack.lists[0] if isinstance(stack, Lists) else stack


def layer_lists(inner: torch.nn.Module, text: Any, model: torch.nn.Module, why: str
                ) -> tuple[torch.nn.Module, Any]:
    """The decoder layers of base model ``inner`` (``text``: its text config; ``model``: the causal-LM model) and
    the module holding them (the last list's, :func:`innermost`): the shallowest list as long as the layer count,
    or as ``num_layers`` where the count is of sub-layers (LongCat-Flash's two attention blocks per layer); where
    none is, the lists of the decoder layer class the model names its unsplittable modules (HRM's two stacks: its
    layer count counts their calls). ``why``: a clause naming why its family's layers are no stack, for the refusal
    where none is found."""
    counts = [int(text.num_hidden_layers), *([text.num_layers] if type(getattr(text, "num_layers", None)) is int
                                             else [])]
    for count in counts:
        found = sorted((name for name, m in inner.named_modules()  # the shallowest, the first of those
                        if isinstance(m, torch.nn.ModuleList) and len(m) == count), key=lambda n: n.count("."))
        if found:
            name = found[0]
            beside = [n for n in found if n.rpartition(".")[0] == name.rpartition(".")[0]]
            if len(beside) > 1:  # XLM's attentions, ffns, layer_norm1, layer_norm2: no list runs a layer whole
                return inner.get_submodule(name.rpartition(".")[0]), Parts([inner.get_submodule(n) for n in beside])
            layers = inner.get_submodule(name)
            assert isinstance(layers, torch.nn.ModuleList)
            return inner.get_submodule(name.rpartition(".")[0]), layers
    named = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, m) for name, m in inner.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and all(type(layer).__name__ in named for layer in m)]
    if len(lists) > 1:
        return inner.get_submodule(lists[-1][0].rpartition(".")[0]), Lists([m for _, m in lists])
    raise ModelInputError(f"cannot find the {counts[0]} decoder layers of {type(inner).__name__}" + why)
