"""``verify``'s look at a quantized output as a reader will load it: from its ``config.json`` and its shards'
headers alone, every quantized weight has its companions, each of the shape its blocks need, and no companion is
left without its weight (the judgement the run's recorded codec passes on an input, one line naming the tensor);
and the role counts found match the ones the run recorded when it planned the output (the ledger's
:data:`~resumerge.merge.store.ledger_read.FORMATS_EVENT`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.inputs.codecs.quantized import recognise
from resumerge.inputs.safetensors_format import read_header


def check_formats(out: Path, shards: Iterable[str], recorded: Mapping[str, Any] | None,
                  codecs: CodecTable = CODECS) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """The output format found in the finished local output ``out`` (its ``shards``: ``{"format", "roles"}``,
    None when it is not quantized) and each problem found, as (tensor or file, one line). ``recorded`` is the
    plan's formats report from the ledger (None: not recorded, a plain run or a run planned before it was). The
    run's recorded codec judges it (else the one its config.json names), found in ``codecs`` (the run's table); an
    output in a format no quantized codec of that table reads is not judged."""
    said = recorded.get("output") if recorded else None
    expected = said if isinstance(said, Mapping) and said.get("format") not in (None, "plain") else None
    config_path = out / "config.json"
    try:  # verify reads it only once its checksum matched; what another tool wrote is still one line, not a crash
        config = json.loads(config_path.read_bytes()) if config_path.is_file() else {}
    except ValueError as exc:
        return None, [("config.json", f"is not valid JSON ({exc})")]
    settings = config.get("quantization_config") if isinstance(config, Mapping) else None
    method = str(settings.get("quant_method", "")) if isinstance(settings, Mapping) else ""
    fmt = codecs.reader(str(expected["format"])) if expected is not None else None
    if fmt is None or (method and method.lower() not in fmt.claims):
        # A format that reads another producer's method too (NVFP4 in compressed-tensors): the config's method's.
        fmt = codecs.reader(method) or fmt
    if isinstance(settings, Mapping) and fmt is None:
        return None, []  # written by a codec a caller plugged in (a test's toy format): not judged here
    if not settings:
        if expected is None:
            return None, []
        return None, [("config.json", f"has no quantization_config, though the run wrote a {expected['format']} "
                                      "output")]
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    try:
        for shard in shards:
            headers.update((name, (e.dtype, tuple(e.shape))) for name, e in read_header(out / shard).tensors.items())
        assert fmt is not None
        verdict = recognise(fmt, settings, headers, source=str(out))
    except ModelInputError as exc:  # a header too damaged to read is the same one line
        return None, [(exc.tensor or "config.json", exc.one_line())]
    found: dict[str, Any] = {"format": verdict.format or "plain", "roles": verdict.role_counts()}
    problems = []
    if expected is not None and dict(expected.get("roles") or {}) != found["roles"]:
        problems.append(("roles", f"the shards hold {_counts(found['roles'])}, the run planned "
                                  f"{_counts(expected.get('roles') or {})}"))
    return found, problems


def _counts(roles: Mapping[str, Any]) -> str:
    return ", ".join(f"{roles.get(role, 0)} {role}" for role in ("weight", "companion", "other"))
