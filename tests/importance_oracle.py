"""The importance pass's sums (``run --imatrix-texts``: :mod:`resumerge.analyses.importance`) of a census model, and
transformers' own: its forward of the same model over the same token ids, each text alone, with a hook before every
``nn.Linear`` (and every router, a ``gate`` module holding a matrix that is not one: transformers 5's top-k routers)
adding the squares of its input (each column apart) in float64, as llama-imatrix sums them.

The pass is run as ``run`` runs it (:func:`~resumerge.analyses.importance.onmerge.importance_on_merge` on the model
opened as a merge never written: a passthrough of it alone), its sums kept by checkpoint module name rather than
named as a GGUF names them (most census families have no GGUF names). ``python tests/importance_oracle.py OUT
FAMILY MODEL STATE`` runs it in a process of its own (the kill tests), the sums saved to OUT."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from resumerge.machine.torch_import import torch


def hooked_sums(directory: Path, texts: list[list[int]]) -> dict[str, torch.Tensor]:
    """transformers' forward of the model in ``directory`` (float32) over ``texts`` (each alone): per ``nn.Linear``
    and router by module name, the float64 sum over every position of its input's squares, per column."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def observe(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[name] = sums[name] + x.square().sum(0) if name in sums else x.square().sum(0)
        return observe

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        router = name.rpartition(".")[2] == "gate" and isinstance(weight, torch.Tensor) and weight.dim() == 2
        if isinstance(module, torch.nn.Linear) or router:
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():  # every hidden state asked for: Gemma 4's key-sharing shortcut fails otherwise (5.24)
        for ids in texts:
            model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return sums


def _alone(directory: Path, root: Path) -> Path:
    """A config that merges the model in ``directory`` with nothing: its weights as they are."""
    config = root / "alone.yaml"
    config.write_text(f"merge_method: passthrough\ndtype: float32\nmodels:\n  - model: {directory}\n")
    return config


def pass_found(directory: Path, texts: list[list[int]], state: Path, costs: bool = False) -> Any:
    """The importance pass over the model in ``directory`` (opened as a merge never written, under ``state``) and
    ``texts``: its sums, experts' counts and (``costs``: a size target's) carried costs, by checkpoint module name
    (:data:`~resumerge.analyses.importance.sums.Found`). Resumes the pass journaled under ``state``."""
    from resumerge import api
    from resumerge.analyses.importance import onmerge

    class Kept(onmerge._ImportanceJob):  # the sums as the pass found them, not named as a GGUF (finish's)
        def finish(self, found: Any, proof: str | None) -> Any:
            return found

    state.mkdir(parents=True, exist_ok=True)
    terms = onmerge.PassTerms("texts", None, "the test's pass", costs=costs)
    with api.open_unwritten(_alone(directory, state), api.Settings(state_dir=state)) as merge:
        original, onmerge._ImportanceJob = onmerge._ImportanceJob, Kept  # type: ignore[misc]
        try:
            return onmerge.importance_on_merge(merge, "llama", texts, state / "imatrix" / "m.gguf", terms)
        finally:
            onmerge._ImportanceJob = original  # type: ignore[misc]


def differences(found: dict[str, torch.Tensor], hooked: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per linear the pass summed, the largest difference from transformers' sum relative to that sum's largest
    value (inf where transformers' forward has no such linear)."""
    return {name: float((value - hooked[name]).abs().max() / hooked[name].abs().max().clamp_min(1e-300))
            if name in hooked and hooked[name].shape == value.shape else float("inf")
            for name, value in found.items()}


def unsummed(hooked: dict[str, torch.Tensor], summed: dict[str, torch.Tensor]) -> list[str]:
    """The linears transformers' forward ran (``hooked``) inside a layer whose other linears the pass summed, and
    it did not: each one's name shares a summed one's up to its first number (``model.layers.3.``). Those outside
    the layers (a head, a projection before the first layer) are not the pass's to sum."""
    missing = []
    for name in sorted(set(hooked) - set(summed)):
        parts = name.split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        layer = ".".join(parts[: digits[0] + 1]) + "." if digits else None
        if layer is not None and any(other.startswith(layer) for other in summed):
            missing.append(name)
    return missing


if __name__ == "__main__":  # OUT FAMILY MODEL STATE [costs]: the pass in a process of its own, its found saved
    sys.path.insert(0, str(Path(__file__).parent))
    from census import texts_of

    out, family, model, state = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    sums, counts, measured = pass_found(model, texts_of(family), state, costs=len(sys.argv) > 5)
    torch.save({"sums": sums, "counts": counts, "costs": measured}, out)
