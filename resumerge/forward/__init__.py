"""The forward engine and the one journaled layer pass every analysis runs on (``check``, ``measure``, ``eval``, the
importance matrix, the MoE hidden-state gates, the search), in rooms by what they hold.

A group: each package here is a layer of its own, with its own ``May import:`` line (tests/test_layout.py holds them
to it), each room importing only the rooms listed above it; this file imports nothing.

- :mod:`.engine`: The layer-streamed forward engine.
- :mod:`.text`: The token sequences a pass runs and how they go through the layers.
- :mod:`.opening`: The models a pass opens.
- :mod:`.job`: The one journaled layer pass every analysis runs on, and its driver.
- :mod:`.compared`: Models run side by side over the same token sequences, as a check compares them, with their
  heads and the bytes their steps hold.
- :mod:`.placing`: Where the run's executor places a forward pass.
- :mod:`.sums`: What the importance pass sums over a model's linears, as llama-imatrix writes it.
"""

__all__ = ["compared", "engine", "job", "opening", "placing", "sums", "text"]
