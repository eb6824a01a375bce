"""The one "is transformers here" helper of every pass: :func:`require_transformers`, told who needs it and how
that one's refusals read (:class:`Needs`), so ``check``, ``measure`` and the MoE gates each say it in their own
words (exit 2, one line, naming the install command) from one place. transformers is imported only where asked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resumerge.errors import InputError

INSTALL_HINT = "pip install transformers (in the resumerge clone: pip install -c constraints.txt -e '.[check]')"


@dataclass(frozen=True)
class Needs:
    """Who needs transformers (``what``: ``resumerge check``, ``gate_mode hidden``) and its refusals' words: the
    line where it is not installed (``missing``, after "needs transformers") with its ``hint``, the words where an
    installed one fails to import (``broken``) with its hint (``broken_hint``; None: ``hint``), and the YAML path
    the refusal names (None: an option, not the config)."""

    what: str
    missing: str = ", and it is not installed"
    hint: str = INSTALL_HINT
    broken: str = "it cannot be imported"
    broken_hint: str | None = None
    yaml_path: str | None = None


def require_transformers(needs: Needs, *, load: bool = True) -> Any:
    """The transformers module (``load``: imported; else only found, None returned, not imported: a pass over a
    family :mod:`.native` builds, with its tokens known, never imports it). Raises :class:`InputError` (exit 2)
    where it is not installed, or where an installed one fails to import (its ImportError named)."""
    from importlib.util import find_spec

    if find_spec("transformers") is None:
        raise InputError(f"{needs.what} needs transformers{needs.missing}", yaml_path=needs.yaml_path,
                         hint=needs.hint)
    if not load:
        return None
    try:
        import transformers
    except ImportError as exc:
        raise InputError(f"{needs.what} needs transformers, and {needs.broken}: {type(exc).__name__}: {exc}",
                         yaml_path=needs.yaml_path,
                         hint=needs.broken_hint if needs.broken_hint is not None else needs.hint) from None
    return transformers
