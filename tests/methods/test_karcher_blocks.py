"""``karcher`` computes a step a block of positions at a time: the same bits as whole-tensor passes.

The reference below is the whole-tensor implementation this replaced (one pass per input and operation);
mergekit 0.1.5 computes the same expressions, so equality here keeps the differential test against it exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from resumerge.merge.methods import karcher as karcher_module
from resumerge.merge.methods.karcher import karcher_mean


def _scaled(factor: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    # Results keep the tensor's dtype, as the buffers they were written into did (two 0-d operands would
    # otherwise promote to float32).
    return (tensor * factor if factor.dtype == tensor.dtype else factor * tensor).to(tensor.dtype)


def _divided(tensor: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    return (tensor / norm).to(tensor.dtype)


def whole_tensor_karcher(tensors: Sequence[torch.Tensor], alphas: Sequence[float], max_iter: int,
                         tol: float) -> torch.Tensor:
    # the start (norms, weights, unit directions) is the module's own: the blocks change only what follows it
    work, norms, weights, points = karcher_module.directions(tensors, alphas, tol)
    if not points:
        return torch.zeros_like(tensors[0])
    mean = torch.zeros_like(points[0])
    for weight, point in zip(weights, points):
        mean = mean + point * weight
    mean_norm = torch.linalg.vector_norm(mean.to(work))
    mean = points[0].clone() if mean_norm.item() < tol else _divided(mean, mean_norm)
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for weight, point in zip(weights, points):
            dot = torch.clamp(torch.dot(mean.flatten(), point.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            tangent = tangent + _scaled(weight * (theta / torch.sin(theta)), point - _scaled(dot, mean))
        tangent_norm = torch.linalg.vector_norm(tangent.to(work))
        if tangent_norm.item() < tol:
            break
        along = _scaled(torch.sin(tangent_norm), _divided(tangent, tangent_norm))
        mean = _scaled(torch.cos(tangent_norm), mean) + along
        unit_norm = torch.linalg.vector_norm(mean.to(work))
        if unit_norm.item() > tol:
            mean = _divided(mean, unit_norm)
    scale = sum((a * n for a, n in zip(alphas, norms)), torch.zeros((), dtype=work))
    return _scaled(scale, mean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(), (7,), (3, 300), (41, 37)])
def test_blocked_steps_give_the_whole_tensor_bits(dtype: torch.dtype, shape: tuple[int, ...],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 64 positions, so every shape but the smallest spans several, one of them partial.
    monkeypatch.setattr(karcher_module, "_BLOCK", 64)
    generator = torch.Generator().manual_seed(len(shape) * 31 + dtype.itemsize)
    for count in (2, 3, 4):
        inputs = [(torch.randn(shape, generator=generator) * (i + 1)).to(dtype) for i in range(count)]
        alphas = [1.0 / count] * count
        ours = karcher_mean(inputs, alphas, max_iter=10, tol=1e-5)
        reference = whole_tensor_karcher(inputs, alphas, 10, 1e-5)
        assert ours.shape == reference.shape and ours.dtype == reference.dtype
        assert torch.equal(ours, reference)
        assert torch.equal(torch.signbit(ours), torch.signbit(reference))


def test_antipodal_and_zero_inputs_match_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(karcher_module, "_BLOCK", 5)
    a = torch.randn(23, generator=torch.Generator().manual_seed(3))
    for inputs in ([a, -a], [a, -a, a * 2], [a, torch.zeros(23), -a * 0.5]):
        ours = karcher_mean(inputs, [1 / len(inputs)] * len(inputs), max_iter=4, tol=1e-5)
        assert torch.equal(ours, whole_tensor_karcher(inputs, [1 / len(inputs)] * len(inputs), 4, 1e-5))
