"""The transplant's unit function: one output matrix (the token embedding or the head) with DONOR's vocabulary.

A pure function of its two inputs (MODEL's matrix, DONOR's) and the run's :class:`Transplant` (in the units'
context's resources, made by the planning from the two tokenizers): rows of matched tokens are MODEL's rows copied
bit for bit, the others approximated one batch at a time (:mod:`~resumerge.transplant.approximate`), each batch
kept in the run's :class:`~resumerge.transplant.batches.BatchStore` once computed, so a resumed run computes only the
batches a killed one had not finished. Random draws come from a generator seeded by (``--random-seed``, the matrix,
the batch's number): never by run order, so a resumed run draws the same numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from resumerge.methods.footprint import measured
from resumerge.methods.spec import MergeContext, MethodSpec, ParamSpec, Scope, declared
from resumerge.torch_import import torch
from resumerge.transplant.approximate import Batch, Method, approximate
from resumerge.transplant.batches import BatchStore
from resumerge.transplant.tokens import MatrixMatch

SURGERY_ROWS = "tokensurgeon_rows"


@dataclass(frozen=True)
class Transplant:
    """One run's matches (by matrix: ``embed``, ``lm_head``), its method and batch size, and where its finished
    batches are kept (None: nowhere, a ``--plan`` estimate)."""

    matches: Mapping[str, MatrixMatch]
    method: Method
    batch_size: int
    store: BatchStore | None = None


def batch_seed(seed: int, matrix: str, batch: int) -> int:
    """The generator seed of batch ``batch`` of ``matrix``: depends only on (seed, matrix, batch)."""
    text = f"{seed}\x00tokensurgeon\x00{matrix}\x00{batch}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


def surgery_rows(ctx: MergeContext) -> torch.Tensor:
    """The matrix ``ctx.params["matrix"]`` with DONOR's vocabulary, in MODEL's dtype (inputs: MODEL's matrix,
    DONOR's)."""
    transplant = ctx.resources.find(Transplant)
    if transplant is None:
        raise ValueError("internal: a transplant's rows need the run's matches (Transplant) in its resources")
    matrix = str(ctx.params["matrix"])
    match = transplant.matches[matrix]
    model = ctx.tensors[0]
    out = torch.zeros((match.rows, model.shape[1]), dtype=model.dtype, device=model.device)
    if match.copies:
        pairs = torch.tensor(match.copies, dtype=torch.long, device=model.device)
        out[pairs[:, 0]] = model[pairs[:, 1]]
    if match.approximated:
        _approximate(ctx, transplant, match, out)
    if match.junk:
        out[torch.tensor(match.junk, dtype=torch.long, device=model.device)] = 0
    return out


def _approximate(ctx: MergeContext, transplant: Transplant, match: MatrixMatch, out: torch.Tensor) -> None:
    """``out``'s approximated rows, batch by batch: each kept batch read back, the others computed and kept."""
    matrix = str(ctx.params["matrix"])
    model, donor = ctx.tensors[0], ctx.tensors[1]
    shared = torch.tensor(match.shared, dtype=torch.long, device=model.device).reshape(-1, 2)
    donor_shared, model_shared = donor[shared[:, 0]], model[shared[:, 1]]
    step = transplant.batch_size if transplant.batch_size > 0 else len(match.approximated)
    params = dict(ctx.params)
    for number, first in enumerate(range(0, len(match.approximated), step)):
        ids = match.approximated[first:first + step]
        key = BatchStore.key(params, number)
        rows = transplant.store.load(key) if transplant.store is not None else None
        if rows is None or rows.shape != (len(ids), model.shape[1]) or rows.dtype != model.dtype:
            generator = torch.Generator(device=model.device).manual_seed(
                batch_seed(int(params["seed"]), matrix, number))
            batch = Batch(donor[torch.tensor(ids, dtype=torch.long, device=model.device)], donor_shared,
                          model_shared, model, match.pieces[first:first + step] if match.pieces else (),
                          lm_head=matrix == "lm_head")
            rows = approximate(transplant.method, batch, generator)
            if transplant.store is not None:
                transplant.store.store(key, rows.cpu())
        out[torch.tensor(ids, dtype=torch.long, device=model.device)] = rows.to(model.device)


_PARAMS = (
    ParamSpec("matrix", Scope.GLOBAL, str, required=True),
    # Digest of the models' file identities, the match and the method: an entry left by another run is never taken.
    ParamSpec("source", Scope.GLOBAL, str, required=True),
    ParamSpec("seed", Scope.GLOBAL, int, required=True),
    ParamSpec("device", Scope.GLOBAL, str, default="cpu"),
)

# Not measured by the profiler replay yet (the figures of tests/methods/footprint_cases.py do not cover a unit of two
# inputs of different shapes): a bound from the code, per element of the larger input — the result and the
# shared rows of both models (at most the inputs' size each, float32 copies of half ones), and a batch's OMP
# workspace, which --batch-size and -k keep far below the matrix for the default 512 × 64.
_FOOTPRINT = measured((12, 8), (16, 10), (16, 10), (24, 16), of_inputs=True)

# The unit functions of a transplant, which its plan hands the engine (Plan.units).
UNITS = declared(
    MethodSpec(name=SURGERY_ROWS, fn=surgery_rows, params=_PARAMS, min_inputs=2, max_inputs=2,
               title="tokensurgeon", reference="https://arxiv.org/abs/2506.06607",
               summary="MODEL's token rows under DONOR's vocabulary: shared tokens copied, the others approximated",
               footprint=_FOOTPRINT, thread_dependent=True),
)
