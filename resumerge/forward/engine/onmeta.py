"""Modules built with their parameters on the meta device (no memory) and their buffers for real: how
:mod:`.stream` builds a model whose weights it gives each module only while it runs.

May import: torch (through resumerge.machine.torch_import).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from resumerge.machine.torch_import import torch

__all__ = ["weights_on_meta"]

# torch.nn.init's in-place initialisers, which :func:`weights_on_meta` makes leave a meta tensor alone.
_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextmanager
def weights_on_meta() -> Iterator[None]:
    """Modules built in the block get their parameters on the meta device (no memory) and their buffers for real:
    buffers are computed from the config (rotary frequencies, an embedding's scale), which the files do not hold.
    The way accelerate's ``init_empty_weights(include_buffers=False)`` builds a model, for this block only.

    Each parameter is marked initialised (``_is_hf_initialized``, the flag transformers' own loading sets on a
    tensor it loaded), so the model's weight initialisation skips it: a meta tensor has no values to draw, yet
    drawing them still ran torch's Python reference of ``normal_`` per weight, most of building the modules (0.4 of
    0.45 s for 120 SmolLM2 layers, paid again by every resumed check). Buffers are not marked: they are still
    initialised as transformers initialises them. For the same reason ``torch.nn.init``'s functions leave a meta
    tensor as it is (a module's own ``reset_parameters``: ``nn.Linear``'s uniform draw), and only a meta one."""
    original = torch.nn.Module.register_parameter
    inits = {name: getattr(torch.nn.init, name) for name in _INITS if hasattr(torch.nn.init, name)}

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            kept = module._parameters[name]
            assert kept is not None
            meta = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            meta._is_hf_initialized = True  # type: ignore[attr-defined]
            module._parameters[name] = meta

    def skipping(init: Callable[..., Any]) -> Callable[..., Any]:
        def on_meta(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return tensor if tensor.is_meta else init(tensor, *args, **kwargs)

        return on_meta

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    for name, init in inits.items():
        setattr(torch.nn.init, name, skipping(init))
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]
        for name, init in inits.items():
            setattr(torch.nn.init, name, init)
