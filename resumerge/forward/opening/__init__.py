"""The models a pass opens: the one opener (:func:`~.opened.open_for_pass`: a local folder, an ``hf://`` repo, a GGUF
file or split set, a GGUF file of a hub repo; headers only), and a hub model's reads held to the hub's checksums,
journaled in a ledger the client hands in (:class:`~.hubreads.PassReads`).

May import: errors, config, inputs.
"""

__all__ = [
    "hubreads",
    "opened",
]
