"""What the importance pass sums over a model's linears, as llama-imatrix writes it: each weight's entry under its GGUF
name (:mod:`.imatrix`), and a mixture of experts' routed projections, per expert (:mod:`.routed`).

May import: errors, inputs, machine, outputs.
"""

__all__ = [
    "imatrix",
    "routed",
]
