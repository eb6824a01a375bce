"""The importance pass's step: each decoder layer read, run over every text with a hook before each of its linears
that adds the squares of the linear's input (every position of the text, each column apart) to a float64 sum, and
dropped. What llama-imatrix accumulates for a weight (``values[j] += x_j²``, ``kquants.md`` §4), of every linear the
layer runs, each its own sum (q/k/v share an input: their sums are equal, as llama-imatrix's entries are).

The sums of every layer run so far are journaled beside the hidden states leaving the layer (float64: a resumed pass
adds to the very values it had), so a pass killed after layer l resumes at l + 1 with them and ends with the same
bytes; so are the experts' counts, and a size target's costs and gains."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

from resumerge.analyses.importance.ahead import ReadAhead
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.journal import Restart
from resumerge.forward.job.layerpass import Reserve, Step
from resumerge.forward.sums.routed import RoutedSums, fused_experts, routers
from resumerge.forward.text.batches import Hidden
from resumerge.inputs.kernels import serial_kernels
from resumerge.machine.torch_import import torch
from resumerge.outputs.gguf.sensitivity import RERUN_TOKENS

# The journal's name of a linear's sums beside the hidden states (apart from what the layers hand on).
SUM_PREFIX = "imatrix:"
COUNT_PREFIX = "imatrix-counts:"  # an experts module's tokens routed to each expert
COST_PREFIX = "cost:"  # a linear's candidate GGUF types over its cost at each (--gguf-target-size)
GAIN_PREFIX = "gain:"  # a layer's index over how much it amplifies an error in its input (--gguf-target-size)
# What the pass gives: the sums, the experts' counts and (measuring) each linear's costs, by module name.
Found = tuple[dict[str, "torch.Tensor"], dict[str, "torch.Tensor"], dict[str, "torch.Tensor"]]


class SumStep(Step[Found]):  # torch: imported when it runs
    """Each layer of ``stream`` run over the texts (``calls``: each text's layers' calls) with its linears' squared
    inputs summed, by checkpoint module name, and its fused experts' per expert
    (:class:`~resumerge.forward.sums.routed.RoutedSums`);
    ``reserve`` admits each layer, ``on_layer(l)`` is told before it; ``ahead``: each layer's weights read (merged)
    while the one before it runs, where the pass has room for it; ``costs``: each dense linear's cost at every
    candidate GGUF type measured too, once the layer's texts ran (its sums whole), while its weights are held: its
    weight error (:func:`~resumerge.outputs.gguf.sensitivity.quantization_costs`) calibrated to the error it makes
    in the layer's output (:class:`Rerun`), and the layer's gain, which carries the costs of the layers before it
    to the last one's output (:func:`carried`). It gives the sums, the experts' counts and the costs."""

    def __init__(self, stream: ModelStream, calls: list[list[LayerCall]], reserve: Reserve,
                 on_layer: Callable[[int], None] | None = None, ahead: ReadAhead | None = None,
                 costs: bool = False) -> None:
        self.stream, self.calls, self.reserve, self.on_layer = stream, calls, reserve, on_layer
        self.ahead, self.measuring = ahead, costs
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.costs: dict[str, torch.Tensor] = {}
        self.gains: dict[str, torch.Tensor] = {}

    def restore(self, restart: Restart) -> None:
        found = restart.tensors.items()
        self.sums = {n.removeprefix(SUM_PREFIX): v.to(torch.float64) for n, v in found if n.startswith(SUM_PREFIX)}
        self.counts = {n.removeprefix(COUNT_PREFIX): v.to(torch.float64) for n, v in found
                       if n.startswith(COUNT_PREFIX)}
        self.costs = {n.removeprefix(COST_PREFIX): v.to(torch.float64) for n, v in found if n.startswith(COST_PREFIX)}
        self.gains = {n.removeprefix(GAIN_PREFIX): v.to(torch.float64) for n, v in found if n.startswith(GAIN_PREFIX)}

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        if self.on_layer is not None:
            self.on_layer(index)
        stream = self.stream
        module = stream.layers_list[index]
        read = self.ahead.take(index) if self.ahead is not None else None
        with self.reserve(f"layer {index} of the merge", "layer"), stream.loaded(module, read=read) as layer:
            if self.ahead is not None:  # the next layer merged while this one runs
                self.ahead.start(index + 1)
            prefix = stream.prefix(module)
            experts = fused_experts(layer)
            hooked = [(n, m) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
            texts = hidden[0]
            # Each text's squares in the order its linears ran, added to the sums once it and the texts before it
            # ran: the additions in the order one thread makes them, so the same bits whichever thread ran a text.
            squares: list[list[tuple[str, torch.Tensor]]] = [[] for _ in texts]
            into = threading.local()
            handles = [m.register_forward_pre_hook(self._hook(prefix + name, into))
                       for name, m in hooked + routers(layer, experts)]

            def run(s: int, h: torch.Tensor) -> torch.Tensor:
                # One text's products are a few dozen rows: split over torch's threads, each waits at the
                # barrier for a core the run's other work (or the machine's) holds, and spins there: 14 of the
                # 41 CPU s of a 2-layer bench route (bench/bench_kquant_route.py --layers 2) went to it. Only
                # the layer's kernels: its weights were merged on entering, with the threads the run merges
                # with. The bits are the run's settings' alone (one thread, whatever -j says).
                into.texts = squares[s]
                try:
                    with serial_kernels():
                        return stream.run(layer, h, self.calls[s][index])
                finally:
                    into.texts = None

            try:
                with ExitStack() as measured:
                    routed = RoutedSums(self.sums, self.counts)
                    for name, m in experts:
                        measured.enter_context(routed.measuring(m, prefix + name))
                    out: list[torch.Tensor] = []
                    if experts:  # routed sums add as they run: one thread
                        for s, h in enumerate(texts):
                            out.append(run(s, h))
                            self._add(squares, s)
                    else:
                        # Two texts at a time: the pass ran on one core with the other idle, the merge's encoding
                        # waiting for its matrix (bench/bench_kquant_route.py times the route). Only short ones: a
                        # text's products and scores are held beside the states the pass's guard counts, not in them
                        # (two long texts' would be twice what one thread holds).
                        with ThreadPoolExecutor(2, thread_name_prefix="resumerge-imatrix") as pool:
                            for pair in _steps([int(h.shape[-2]) for h in texts]):
                                out.extend(pool.map(run, pair, [texts[i] for i in pair]))
                                for i in pair:
                                    self._add(squares, i)
            finally:
                for handle in handles:
                    handle.remove()
            if self.measuring and not experts:
                rerun = Rerun(stream, layer, index, [self.calls[s][index] for s in range(len(texts))], texts, out)
                self._measure(prefix, hooked, sum(h.numel() // h.shape[-1] for h in texts), rerun)
        return [out]

    def _measure(self, prefix: str, linears: Sequence[tuple[str, torch.nn.Linear]], tokens: int,
                 rerun: Rerun) -> None:
        """Each of ``linears``' cost at its candidate types, with its importance (its sums over ``tokens``): its
        weight error at each, relative to its probe type's, times the error the probe makes in the layer's output
        (the layer run again with the matrix quantized: :class:`Rerun`); and the layer's gain (an error in its input,
        as it leaves the layer), which :meth:`finish` carries back to the layers before."""
        from resumerge.inputs.gguf.blocks import decode
        from resumerge.outputs.gguf.encoders import encode
        from resumerge.outputs.gguf.sensitivity import candidate_types, probe_type, quantization_costs

        for name, module in linears:
            weight, sums = module.weight, self.sums.get(prefix + name)
            types = candidate_types(int(weight.shape[-1]))
            if weight.dim() != 2 or sums is None or not types or tokens == 0:
                continue
            importance = (sums / tokens).to(torch.float32).numpy()
            measured = quantization_costs(weight.data, importance, types)
            probe = probe_type(types)
            relative = measured[types.index(probe)]
            if relative > 0.0:
                held = weight.data.to("cpu", torch.float32)
                with serial_kernels():  # small elementwise kernels, as quantization_costs' are
                    quantized = decode(encode(held, probe, importance=importance), probe).reshape(held.shape)
                measured = measured * (rerun.error(module, quantized.to(weight.dtype)) / relative)
            self.costs[prefix + name] = torch.tensor([list(types), measured.tolist()], dtype=torch.float64)
        if linears:
            self.gains[prefix] = torch.tensor([float(rerun.index), rerun.gain()], dtype=torch.float64)

    def _add(self, squares: list[list[tuple[str, torch.Tensor]]], text: int) -> None:
        """Text ``text``'s squares added to the sums, in the order its linears ran, and dropped."""
        for name, value in squares[text]:
            found = self.sums.get(name)
            self.sums[name] = value if found is None else found.add_(value)
        squares[text] = []

    def _hook(self, name: str, into: threading.local) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def observe(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            # squared in place: one float64 copy of the input held, not two (a wide MLP's down projection's input,
            # 8 bytes a value of each of a text's tokens)
            into.texts.append((name, x.reshape(-1, x.shape[-1]).to("cpu", torch.float64).square_().sum(dim=0)))

        return observe

    def kept(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
        return {**{SUM_PREFIX + name: value for name, value in sorted(self.sums.items())},
                **{COUNT_PREFIX + name: value for name, value in sorted(self.counts.items())},
                **{COST_PREFIX + name: value for name, value in sorted(self.costs.items())},
                **{GAIN_PREFIX + name: value for name, value in sorted(self.gains.items())}}, None

    def finish(self, hidden: Hidden) -> Found:
        return (dict(sorted(self.sums.items())), dict(sorted(self.counts.items())),
                carried(self.costs, self.gains))


def carried(costs: dict[str, torch.Tensor], gains: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``costs`` (by module name: [types; the error each makes in its layer's output]) as the error they make
    where the last layer leaves: each times the gains (by layer prefix: [index, gain]) of the layers after its
    own, by name."""
    order = sorted(gains.items(), key=lambda item: float(item[1][0]))
    after: dict[str, float] = {}
    product = 1.0
    for prefix, found in reversed(order):
        after[prefix] = product
        product *= float(found[1])
    out: dict[str, torch.Tensor] = {}
    for name, values in sorted(costs.items()):
        owners = [p for p in after if name.startswith(p)]
        scale = after[max(owners, key=len)] if owners else 1.0
        out[name] = torch.stack([values[0], values[1] * scale])
    return out


class Rerun:
    """Layer ``index`` of ``stream`` (``layer``, loaded) run again on the first texts of the pass's (``texts``, the
    previous step's outputs, under ``calls``; ``out`` their outputs), up to :data:`RERUN_TOKENS` of them: the error
    in its output when one matrix's weight is another (:meth:`error`), or its input carries a small error
    (:meth:`gain`). Its input is what the forward gives it (:meth:`~resumerge.forward.engine.stream.ModelStream.
    entered`: Dory's loop start, the previous output's norm plus the input section's, computed again), as the pass's
    own run of it was given. One thread, the texts in order, sums in float64: a resumed pass measures the same bits."""

    def __init__(self, stream: ModelStream, layer: torch.nn.Module, index: int, calls: list[LayerCall],
                 texts: list[torch.Tensor], out: list[torch.Tensor]) -> None:
        self.stream, self.layer, self.index = stream, layer, index
        count, tokens = 0, 0
        while count < len(texts) and tokens < RERUN_TOKENS:
            tokens += texts[count].numel() // texts[count].shape[-1]
            count += 1
        self.calls, self.out, self.tokens = calls[:count], out[:count], tokens
        # (given the previous output as it is, a loop's start had run on other input than the pass's: the error of
        # its own weight was not 0, the gain of another function)
        self.texts = [stream.entered(h, call, index) for h, call in zip(texts[:count], self.calls, strict=True)]

    def _error(self, inputs: Sequence[torch.Tensor]) -> float:
        total = 0.0
        with serial_kernels():
            for h, call, was in zip(inputs, self.calls, self.out, strict=True):
                found = self.stream.run(self.layer, h, call, hand_on=False)
                total += float((found.to(torch.float64) - was.to(found.device, torch.float64)).square().sum())
        return total / max(self.tokens, 1)

    def error(self, module: torch.nn.Linear, weight: torch.Tensor) -> float:
        """The mean squared error per token in the layer's output with ``module``'s weight ``weight``."""
        held = module.weight.data
        module.weight.data = weight.to(held.device)
        try:
            return self._error(self.texts)
        finally:
            module.weight.data = held

    def gain(self) -> float:
        """The squared error leaving the layer over the one entering it, for an error in its input of
        :data:`GAIN_ERROR` of each position's root mean square, in directions drawn from a generator seeded with the
        layer's index: how much an earlier layer's error grows on its way through this one."""
        moved, entering = [], 0.0
        generator = torch.Generator().manual_seed(self.index)
        for h in self.texts:
            noise = torch.randn(h.shape, generator=generator, dtype=torch.float32)
            scale = h.detach().to("cpu", torch.float32).square().mean(dim=-1, keepdim=True).sqrt() * GAIN_ERROR
            delta = (noise * scale).to(h.device, h.dtype)
            entering += float(delta.to(torch.float64).square().sum())
            moved.append(h + delta)
        return self._error(moved) * max(self.tokens, 1) / entering if entering > 0.0 else 1.0


# The error put in a layer's input to measure its gain, relative to each position's root mean square.
GAIN_ERROR = 1e-2


# The longest texts run two at a time (tokens): llama-imatrix's default chunk. Longer ones run alone.
_PAIRED_TOKENS = 512


def tokens_at_once(lengths: Sequence[int]) -> int:
    """The most tokens of texts (by their token counts ``lengths``, in order) a layer runs at once: a pair's, or a
    long text's (:func:`_steps`)."""
    return max((sum(lengths[i] for i in step) for step in _steps(lengths)), default=0)


def rerun_tokens(lengths: Sequence[int]) -> int:
    """The tokens of the first texts (by their token counts ``lengths``, in order) :class:`Rerun` runs again: up to
    :data:`RERUN_TOKENS`, the text that reaches it whole."""
    tokens = 0
    for n in lengths:
        if tokens >= RERUN_TOKENS:
            break
        tokens += n
    return tokens


def _steps(lengths: Sequence[int]) -> list[list[int]]:
    """The texts (by their token counts ``lengths``) in order, two at a time where both are short
    (:data:`_PAIRED_TOKENS`), else one."""
    steps: list[list[int]] = []
    for i, n in enumerate(lengths):
        if steps and len(steps[-1]) == 1 and n <= _PAIRED_TOKENS and lengths[steps[-1][0]] <= _PAIRED_TOKENS:
            steps[-1].append(i)
        else:
            steps.append([i])
    return steps
