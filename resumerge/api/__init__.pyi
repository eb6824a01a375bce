"""What type checkers read of :mod:`resumerge.api`: generated from its names by
``python tests/test_api_stub.py``; not edited by hand."""

from resumerge.api.calls import (
    check,
    estimate,
    estimate_extraction,
    estimate_measure,
    evaluate,
    evolve,
    extract_lora,
    measure,
    plan_merge,
    resume,
    run,
)
from resumerge.api.evolution import EvolveOutcome
from resumerge.api.lmevaldoor import lm_eval
from resumerge.api.options import (
    Harness,
    Hub,
    Lora,
    Merging,
    Output,
    Resources,
    Search,
    Settings,
    Stages,
    Surgery,
    Trackers,
)
from resumerge.api.reading import evolve_status, recipe_status, status, verify
from resumerge.api.transplanting import estimate_tokensurgeon, tokensurgeon
from resumerge.api.unwritten import open_population, open_unwritten

__all__ = [
    "EvolveOutcome", "Harness", "Hub", "Lora", "Merging", "Output", "Resources", "Search", "Settings", "Stages",
    "Surgery", "Trackers", "check", "estimate", "estimate_extraction", "estimate_measure", "estimate_tokensurgeon",
    "evaluate", "evolve", "evolve_status", "extract_lora", "lm_eval", "measure", "open_population", "open_unwritten",
    "plan_merge", "recipe_status", "resume", "run", "status", "tokensurgeon", "verify"
]
