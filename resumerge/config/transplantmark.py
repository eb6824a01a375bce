"""What a run's recorded text says of a transplant (``resumerge tokensurgeon``): its key, and the MODEL it names.
A module of its own, json alone: ``status`` reads it, and must not import the YAML config reader."""

from __future__ import annotations

import json

# The key of a transplant's recorded text (:func:`resumerge.runs.transplant.spec.spec_text`: ``{"tokensurgeon":
# {"model": MODEL, "donor": DONOR, ...}}``), which no merge config holds.
TRANSPLANT_MARK = "tokensurgeon"


def transplanted_model(text: str) -> str | None:
    """MODEL of a transplant whose recorded text is ``text`` (what ``check`` compares its output with, as a
    merge's record names its base); None for any other text."""
    try:
        body = json.loads(text).get(TRANSPLANT_MARK)
    except (ValueError, AttributeError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None
