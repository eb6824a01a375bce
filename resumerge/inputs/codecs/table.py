"""The formats a run recognises, and one model's stored tensors sorted into logical tensors by them.

A :class:`CodecTable` is a per-run value handed to the planner (no module-level registry: a test or a notebook
plugs a format in by passing a table that lists it); :data:`CODECS` is the table every run uses by default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.inputs.codecs.compressed import CompressedTensorsCodec
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.inputs.codecs.mxfp4 import Mxfp4Codec
from resumerge.inputs.codecs.nvfp4 import Nvfp4Codec
from resumerge.inputs.codecs.plain import PLAIN
from resumerge.inputs.codecs.protocol import MAIN, Claim, Role, TensorDecoder
from resumerge.inputs.codecs.quantized import QuantizedCodec, recognise
from resumerge.inputs.files import TensorSource
from resumerge.inputs.gguf.codec import GgufCodec
from resumerge.inputs.quant.refusals import HeaderMap, refuse_method, refuse_unconfigured
from resumerge.inputs.quant.verdict import Checkpoint


@dataclass(frozen=True)
class StoredFormats:
    """One model's ``stored`` tensors (by stored name) as logical tensors: the claimed ones (by logical name) and
    every stored tensor's :class:`~resumerge.inputs.codecs.protocol.Role` (by stored name)."""

    stored: Mapping[str, TensorSource]
    claims: Mapping[str, Claim]
    roles: Mapping[str, Role]

    def codec(self, name: str) -> TensorDecoder:
        """The codec of logical tensor ``name`` (plain when no format claims it)."""
        claim = self.claims.get(name)
        return claim.codec if claim is not None else PLAIN

    def companions(self, name: str) -> tuple[tuple[str, TensorSource], ...]:
        """Where the companions of logical tensor ``name`` are, by part name (none for a plain tensor)."""
        claim = self.claims.get(name)
        return () if claim is None else tuple((part, self.stored[stored]) for part, stored in claim.companions)

    def logical(self) -> Mapping[str, TensorSource]:
        """What the planner matches names against: every plain tensor under its own name, each claimed tensor
        under its logical name at its main part's place, no companion."""
        if not self.claims:
            return self.stored
        roles, stored, other = self.roles, self.stored, Role.OTHER
        view = {name: found for name, found in stored.items() if roles[name] is other}
        view.update((name, stored[claim.main]) for name, claim in self.claims.items())
        return view

    def role_counts(self) -> dict[str, int]:
        """How many stored tensors have each role, by the role's name (every role listed)."""
        counts = Counter(self.roles.values())  # the members counted, not 92k `.value` lookups
        return {role.value: counts[role] for role in Role}


@dataclass(frozen=True)
class CodecTable:
    """The stored formats of one run, tried in order; a tensor none of them claims is plain."""

    formats: tuple[type[TensorDecoder], ...] = ()

    def recognise(self, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
                  *, where: str = "") -> StoredFormats:
        """Sort the stored ``tensors`` of the model at ``where`` (its ``config.json`` is ``config``) into logical
        tensors. Raises :class:`~resumerge.errors.ModelInputError` for what a format refuses, a part that is not
        among ``tensors``, a stored tensor two claims share, or a logical name that is another stored tensor's."""
        claims: dict[str, Claim] = {}
        roles = dict.fromkeys(tensors, Role.OTHER)
        owner: dict[str, str] = {}
        shared: dict[object, Any] = {}
        for fmt in self.asked(config, tensors, where):
            try:
                found = fmt.recognise_among(config, tensors, shared)
            except ModelInputError as exc:
                if exc.path is None:  # a format judges tensors, not folders: name the model
                    exc.path = where or None
                raise
            weight, companion = Role.WEIGHT, Role.COMPANION  # looked up once, not per part of 45k claims
            for claim in found:
                name = claim.name
                for part, stored in claim.parts:
                    if stored not in tensors:
                        raise ModelInputError(f"{fmt.name} tensor {name} has no {part} ({stored})",
                                              path=where, tensor=name)
                    if stored in owner:
                        raise ModelInputError(f"stored tensor {stored} belongs to both {owner[stored]} and "
                                              f"{name}", path=where, tensor=stored)
                    owner[stored] = name
                    roles[stored] = weight if part == MAIN else companion
                if claims.setdefault(name, claim) is not claim:
                    raise ModelInputError(f"{name} is claimed twice", path=where, tensor=name)
        for name, claim in claims.items():
            if name in tensors and owner.get(name) != name:
                raise ModelInputError(f"{name} is a stored tensor of its own, not one of its {claim.codec.name} parts",
                                      path=where, tensor=name)
        return StoredFormats(tensors, claims, roles)

    @property
    def methods(self) -> tuple[str, ...]:
        """Every ``quant_method`` a format of this table claims, in the table's order."""
        return tuple(dict.fromkeys(method for fmt in self.formats for method in fmt.claims))

    @property
    def quantized(self) -> tuple[type[QuantizedCodec], ...]:
        """The quantized safetensors formats of this table (each finds its own weights from the headers)."""
        return tuple(fmt for fmt in self.formats if issubclass(fmt, QuantizedCodec))

    def reader(self, name: str) -> type[QuantizedCodec] | None:
        """The quantized format of this table named ``name`` (a codec's name, as a run records its output's format,
        or a ``quant_method`` it claims), or None."""
        name = name.lower()
        return next((fmt for fmt in self.quantized if name == fmt.name or name in fmt.claims), None)

    def verdict(self, quantization_config: Mapping[str, Any] | None, headers: HeaderMap, *,
                source: str = "") -> Checkpoint:
        """What the format claiming a checkpoint's ``quant_method`` finds in it (``quantization_config``: None or
        empty when config.json has none; ``headers``: every shard's tensors): per stored tensor its role and per
        quantized weight how it decodes. Raises the one-line refusal (exit 2) for a method no quantized format of
        this table claims, and each format's own for what it cannot decode; ``source`` names the model."""
        if not quantization_config:
            refuse_unconfigured(headers, source)
            return Checkpoint(None, {}, tuple(headers))
        method = str(quantization_config.get("quant_method", "")).lower()
        # By the methods the formats claim, not their names: NVFP4's codec is named "nvfp4", no producer's method.
        fmt = next((f for f in self.quantized if method in f.claims), None) if method else None
        if fmt is None:
            raise refuse_method(method or "(none)", headers, source,
                                tuple(dict.fromkeys(m for f in self.quantized for m in f.claims)))
        return recognise(fmt, quantization_config, headers, source)

    def asked(self, config: Mapping[str, Any], tensors: Mapping[str, TensorSource],
              where: str = "") -> tuple[type[TensorDecoder], ...]:
        """The formats asked about a model whose ``config.json`` is ``config``: every one when it names no
        ``quant_method`` (each may still find its own telltales, or refuse another format's), else those that
        claim its method. Raises the one-line refusal (exit 2) for a ``quantization_config`` whose method no
        format of this table claims, before any format reads a header."""
        quantization = config.get("quantization_config")
        if not quantization:
            return self.formats
        method = str(quantization.get("quant_method", "") if isinstance(quantization, Mapping) else "").lower()
        asked = tuple(fmt for fmt in self.formats if method and method in fmt.claims)
        if not asked:
            raise refuse_method(method or "(none)", tensors, where, self.methods)
        return asked


# The formats every run recognises: block FP8, compressed-tensors, MXFP4 and NVFP4 (ModelOpt's; each refuses, for
# all of them, a checkpoint quantized in a format resumerge cannot decode), and GGUF files (inputs/gguf).
CODECS = CodecTable((BlockFp8Codec, CompressedTensorsCodec, Mxfp4Codec, Nvfp4Codec, GgufCodec))
