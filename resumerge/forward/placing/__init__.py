"""Where the run's executor places a forward pass: one site per executor, found by its name (:mod:`.sites`), and a Ray
cluster's share of it: where each model's actor runs and how a model travels to it (:mod:`.onray`), the driver's
side of the actors (:mod:`.rayactor`) and one model as its node runs it (:mod:`.modelnode`).

May import: errors, config, inputs, machine, forward.engine, forward.text, forward.opening, forward.job,
forward.compared.
"""

__all__ = [
    "modelnode",
    "onray",
    "rayactor",
    "sites",
]
