"""A mixture of experts' routed projections in the importance pass: what llama-imatrix accumulates for a
``MUL_MAT_ID`` (``kquants.md`` §4): per expert, the sum of the squares of the inputs routed to it (one row of
``n_in`` values each) and the count of the tokens routed to it.

transformers 5 holds a layer's routed experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]) and runs them in the experts module's own forward (``F.linear`` on one expert's slice), so no linear's
hook sees one expert's inputs. For the pass, that module's forward is replaced by :func:`_measured_forward`:
transformers' eager experts forward, step for step (each expert hit, in order; its tokens gathered, gate/up, the
activation, down, scaled by the routing weight and added back), which adds each expert's inputs' squares as it
feeds them: the hidden states of its tokens for gate/up, the activation product for down. Those are the very
inputs each expert computed with, whatever its router chose. The router (a matrix applied to every token,
``ffn_gate_inp``: llama-imatrix records its matmul too) is hooked as a linear is.

Here in the forward pass's library, not in an analysis: the importance pass over a merge never written
(:mod:`resumerge.analyses.importance.sums`) and ``measure``'s Grams (``measure --imatrix`` of a mixture of experts)
both run it, and no analysis imports another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from resumerge.errors import ResumergeError
from resumerge.machine.torch_import import torch

# The fused stacks' parameter names (transformers 5's experts modules): gate/up share an input, down its own.
GATE_UP, DOWN = "gate_up_proj", "down_proj"


def fused_experts(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules of ``layer`` whose routed projections are fused stacks (by module name within it)."""
    found = []
    for name, module in layer.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if GATE_UP in params and DOWN in params and params[GATE_UP].dim() == 3:
            found.append((name, module))
    return found


def routers(layer: torch.nn.Module, experts: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """The routers beside ``experts`` (their block's ``gate``, a matrix over the hidden states that is not an
    ``nn.Linear``: transformers 5's top-k routers), by module name within ``layer``."""
    found = []
    for name, _ in experts:
        parent = name.rpartition(".")[0]
        router = dict((layer.get_submodule(parent) if parent else layer).named_children()).get("gate")
        weight = getattr(router, "weight", None)
        if router is not None and not isinstance(router, torch.nn.Linear) and isinstance(weight, torch.Tensor) \
                and weight.dim() == 2:
            found.append((f"{parent}.gate" if parent else "gate", router))
    return found


class RoutedSums:
    """The routed experts' sums and counts of a pass: ``sums`` float64 [E, n_in] by checkpoint name of each fused
    stack (``model.layers.0.mlp.experts.gate_up_proj``), ``counts`` float64 [E] (the tokens routed to each expert)
    by the experts module's (``model.layers.0.mlp.experts``); held in the step's dicts, journaled with the dense
    sums."""

    def __init__(self, sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor]) -> None:
        self.sums, self.counts = sums, counts

    @contextmanager
    def measuring(self, module: torch.nn.Module, name: str) -> Iterator[None]:
        """``module`` (an experts module whose checkpoint name is ``name``) run by :func:`_measured_forward` while
        the block runs, its own forward after."""
        for flag, plain in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                            ("has_gate", True), ("has_post_expert_norm", False)):
            if getattr(module, flag, plain) != plain:  # a layout the eager forward below does not compute
                raise ResumergeError(f"the importance matrix pass cannot measure {name}'s experts ({flag} is "
                                     f"{not plain}): resumerge does not write such a family as GGUF")
        experts = int(_parameter(module, GATE_UP).shape[0])
        counts = self.counts.setdefault(name, torch.zeros(experts, dtype=torch.float64))

        def add(stack: str, expert: int, rows: torch.Tensor) -> None:
            key = f"{name}.{stack}"
            if key not in self.sums:
                self.sums[key] = torch.zeros(experts, rows.shape[-1], dtype=torch.float64)
            self.sums[key][expert] += rows.to(torch.float64).square().sum(dim=0)
            if stack == GATE_UP:  # one count per expert: the tokens routed to it (down's rows are as many)
                counts[expert] += rows.shape[0]

        module.forward = _measured_forward(module, add)  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.forward


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor:
    return module.get_parameter(name)


def _measured_forward(module: torch.nn.Module, add: Callable[[str, int, torch.Tensor], None]
                      ) -> Callable[..., torch.Tensor]:
    """transformers' eager experts forward of ``module`` (``forward(hidden_states, top_k_index, top_k_weights)``),
    each expert's inputs handed to ``add(stack, expert, rows)`` as it computes with them. The stacks are looked up
    as it runs: it may be installed before the layer's weights are read (``measure``'s watch is)."""
    act = module.get_submodule("act_fn")
    experts = _parameter(module, GATE_UP).shape[0]

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        gate_up, down = _parameter(module, GATE_UP), _parameter(module, DOWN)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.greater(torch.nn.functional.one_hot(top_k_index, num_classes=experts + 1)
                                .sum(dim=(0, 1)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            if expert == experts:  # transformers' index for a token sent nowhere (expert parallelism)
                continue
            position, token = torch.where(top_k_index.transpose(0, 1) == expert)
            current = hidden_states[token]
            add(GATE_UP, expert, current)
            gate, up = torch.nn.functional.linear(current, gate_up[expert]).chunk(2, dim=-1)
            inner = act(gate) * up
            add(DOWN, expert, inner)
            out = torch.nn.functional.linear(inner, down[expert]) * top_k_weights[token, position, None]
            final.index_add_(0, token, out.to(final.dtype))
        return final

    return forward
