"""Plan a transplant: open MODEL and DONOR (headers only), find their token embeddings and heads, match the two
vocabularies, and freeze a :class:`Plan` of the output.

The plan is the same kind a merge has, so the session path runs it unchanged: MODEL's tensors copied as a
passthrough merge copies them (``passthrough``), the token embedding and an untied head computed by this package's
unit (:data:`~resumerge.runs.transplant.units.SURGERY_ROWS`) from MODEL's matrix and DONOR's, config.json MODEL's with
DONOR's vocabulary size and special token ids, and DONOR's tokenizer files copied byte for byte, but for what they
add around a text where MODEL's tokenizer adds otherwise (its BOS: :mod:`.adds`).

Which of DONOR's tensors is MODEL's embedding's counterpart: the tensor of the same name (as mergekit reads it by
MODEL's architecture); a DONOR that has none (another architecture's names) is refused unless ``--allow-crimes``,
which then takes DONOR's own token embedding. A tied MODEL gets its embedding alone (its head stays tied); an
untied MODEL's head is made from DONOR's head, or from DONOR's embedding where DONOR's head is tied to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

import resumerge.runs.transplant.units as registered
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import MergeConfig, load_config_text
from resumerge.config.modelref import parse_model_ref
from resumerge.errors import ResumergeError, UsageError
from resumerge.inputs.catalog import Inputs, open_inputs
from resumerge.inputs.codecs import CODECS
from resumerge.inputs.files import tokenizer_files
from resumerge.inputs.hub import HubEvent
from resumerge.inputs.model import ModelInput
from resumerge.inputs.safetensors_format import DTYPE_SIZES, numel
from resumerge.merge.plan.architecture import architecture_of, is_head, is_input_embedding, layer_count
from resumerge.merge.plan.cardwording import CardWording
from resumerge.merge.plan.changes import CARD_PART, READ_PART
from resumerge.merge.plan.inputrefs import tensor_ref
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions, TensorPlan, fingerprinted
from resumerge.merge.plan.outconfig import set_quantization
from resumerge.merge.plan.placing import Placing, place_files
from resumerge.merge.plan.sharding import assign_shards, output_naming, resolve_shard_size
from resumerge.merge.plan.tokenizer_plan import tokenizer_dir, tokenizer_hashes
from resumerge.outputs.containers import container_class, container_for
from resumerge.runs.transplant.adds import OutputAdds, out_config_ids, rewritten
from resumerge.runs.transplant.approximate import Method, Rope, method_notes
from resumerge.runs.transplant.spec import USES_K, SurgerySpec, check_spec
from resumerge.runs.transplant.tokens import MatrixMatch, Normalized, Vocabulary, load_vocabulary, match_matrix

METHOD = "tokensurgeon"
# The output's copy of the recorded options (mergekit writes none; resumerge writes the run's text beside the card).
CONFIG_COPY = "tokensurgeon.json"
# config.json keys taken from DONOR's (mergekit 0.1.5's list): the token ids follow the tokenizer.
_DONOR_KEYS = ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id", "mask_token_id", "padding_side")
_FLAG_OF = MappingProxyType({"models[0]": "MODEL", "base_model": "MODEL", "models[1]": "DONOR"})


@dataclass(frozen=True)
class Opened:
    """The two models opened for planning: the inputs, their keys, and the config they were opened by (the card
    lists its models)."""

    inputs: Inputs
    model_key: str
    donor_key: str
    config: MergeConfig

    def tokenizer_files(self, key: str) -> Mapping[str, bytes] | None:
        """The tokenizer files of input ``key`` when it is a GGUF (rebuilt from its metadata), else None."""
        model = self.inputs.models[key].recognised(CODECS)
        if model.gguf is None:
            return None
        from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

        return gguf_tokenizer_files(model.directory / model.gguf, model.gguf_header)

    @property
    def model(self) -> ModelInput:
        return self.inputs.models[self.model_key].recognised(CODECS)

    @property
    def donor(self) -> ModelInput:
        return self.inputs.models[self.donor_key].recognised(CODECS)


@dataclass(frozen=True)
class Matrices:
    """The tensor names of each matrix the output rebuilds: (MODEL's, DONOR's) by ``embed``/``lm_head``."""

    names: Mapping[str, tuple[str, str]]


def open_pair(spec: SurgerySpec, *, model_dirs: Mapping[str, str] | None = None, state: StateDir | None = None,
              cache_dir: str | os.PathLike[str] | None = None,
              on_progress: Callable[[HubEvent], None] | None = None) -> Opened:
    """Open MODEL and DONOR (config.json and headers; hub ids resolved or streamed as for merges)."""
    check_spec(spec)
    for text, what in ((spec.model, "MODEL"), (spec.donor, "DONOR")):
        try:
            parse_model_ref(text)
        except ValueError as exc:
            raise UsageError(f"{what}: {exc}") from None
    doc = {"merge_method": "passthrough", "base_model": spec.model,
           "models": [{"model": spec.model}, {"model": spec.donor}]}
    try:
        config = load_config_text(yaml.safe_dump(doc, sort_keys=False), source="tokensurgeon")
        inputs = open_inputs(config, model_dirs=model_dirs, state=state, cache_dir=cache_dir, on_progress=on_progress)
    except ResumergeError as exc:
        exc.yaml_path = _FLAG_OF.get((exc.yaml_path or "").split(".")[0], exc.yaml_path)
        raise
    return Opened(inputs, parse_model_ref(spec.model).key, parse_model_ref(spec.donor).key, config)


def find_matrices(opened: Opened, *, allow_crimes: bool) -> Matrices:
    """The embedding (and untied head) of MODEL and their counterparts in DONOR; UsageError when MODEL has none, or
    DONOR lacks MODEL's names without ``allow_crimes``."""
    model, donor = opened.model, opened.donor
    embed = _one(model, is_input_embedding, "token embedding", "MODEL")
    head = _head(model)
    donor_embed = embed if embed in donor.tensors else None
    if donor_embed is None:
        if not allow_crimes:
            raise UsageError(
                f"DONOR ({architecture_of(donor.config) or 'unknown architecture'}) has no {embed}, MODEL's "
                f"({architecture_of(model.config) or 'unknown architecture'}) token embedding",
                hint="pass --allow-crimes to take DONOR's own token embedding as its counterpart")
        donor_embed = _one(donor, is_input_embedding, "token embedding", "DONOR")
    names = {"embed": (embed, donor_embed)}
    if head is not None:
        donor_head = head if head in donor.tensors else _head(donor) if allow_crimes else None
        names["lm_head"] = (head, donor_head if donor_head is not None else donor_embed)  # DONOR tied: its embedding
    for name, (mine, theirs) in names.items():
        if len(model.tensors[mine].entry.shape) != 2 or len(donor.tensors[theirs].entry.shape) != 2:
            raise UsageError(f"tokensurgeon needs matrices: the {name} tensors are {mine} and {theirs}")
    return Matrices(names)


def vocabularies(opened: Opened, *, subword: bool = False) -> tuple[Vocabulary, Vocabulary]:
    """MODEL's and DONOR's normalized vocabularies (reads both tokenizers; a GGUF's rebuilt from its metadata).
    ``subword``: MODEL's tokenizer cuts the approximated tokens, so it is transformers' own (see
    :func:`~resumerge.runs.transplant.tokens.load_vocabulary`)."""
    found = []
    for what, key in (("MODEL", opened.model_key), ("DONOR", opened.donor_key)):
        files = opened.tokenizer_files(key)
        direct = not (subword and key == opened.model_key)
        if files is None:
            found.append(load_vocabulary(tokenizer_dir(opened.inputs.models[key].recognised(CODECS)), what=what,
                                         direct=direct))
            continue
        with tempfile.TemporaryDirectory(prefix="resumerge-tokensurgeon-") as scratch:
            for name, data in files.items():
                (Path(scratch) / name).write_bytes(data)
            found.append(load_vocabulary(Path(scratch), what=what, direct=direct))
    return found[0], found[1]


def donor_head(opened: Opened, matrices: Matrices) -> str:
    """DONOR's head, or its embedding where its head is tied (what ``--magikarp`` reads of it)."""
    return _head(opened.donor) or matrices.names["embed"][1]


def match_vocabularies(opened: Opened, spec: SurgerySpec, matrices: Matrices, vocabs: tuple[Vocabulary, Vocabulary],
                       trained: set[Normalized] | None = None, junk: tuple[int, ...] = (), *,
                       out_type: str = "safetensors") -> dict[str, MatrixMatch]:
    """Each matrix's match of DONOR's tokens to MODEL's rows; ``trained`` and ``junk`` as ``--magikarp`` found them
    (see :func:`~resumerge.runs.transplant.tokens.match_matrix`); a GGUF output (``out_type``) of a GGUF DONOR has the
    rows of DONOR's file, whose vocabulary it holds."""
    mine, theirs = vocabs
    cap = container_class(out_type).self_contained and opened.donor.gguf is not None
    matches = {}
    for matrix, (name, donor_name) in matrices.names.items():
        match = match_matrix(mine, theirs, opened.model.tensors[name].entry.shape[0],
                             opened.donor.tensors[donor_name].entry.shape[0], matrix=matrix, choices=spec,
                             trained=trained, junk=junk, cap=cap)
        if match.approximated and spec.approximation_method in USES_K and spec.k > len(match.shared):
            raise UsageError(f"-k {spec.k} is more than the {len(match.shared)} tokens MODEL and DONOR share",
                             hint=f"pass -k {max(1, len(match.shared))} or less, or another --approximation-method")
        if match.approximated and spec.approximation_method == "landmark_pca" and len(match.shared) < 2:
            raise UsageError("landmark_pca needs at least two tokens MODEL and DONOR share")
        matches[matrix] = match
    return matches


def build_plan(spec: SurgerySpec, opened: Opened, matrices: Matrices, matches: Mapping[str, MatrixMatch],
               options: PlanOptions, adds: OutputAdds | None = None) -> Plan:
    """The frozen plan of the transplant (pure: headers, the matches, what the output's tokenizer adds around a
    text: ``adds``, :mod:`.adds`; None: what DONOR's adds)."""
    model, donor = opened.model, opened.donor
    method = surgery_method(spec, opened, matrices)
    source = _source_digest(opened, spec, matches, method.rope)
    rebuilt = {name: matrix for matrix, (name, _) in matrices.names.items()}
    tensors: dict[str, TensorPlan] = {}
    for name in model.tensors:
        ref = tensor_ref(opened.model_key, model, name)
        if name in rebuilt:
            matrix = rebuilt[name]
            donor_ref = tensor_ref(opened.donor_key, donor, matrices.names[matrix][1])
            mine, theirs = model.tensors[name].entry, donor.tensors[matrices.names[matrix][1]].entry
            shapes = ((mine.shape[0], mine.shape[1], DTYPE_SIZES[ref.value_dtype]),
                      (theirs.shape[0], theirs.shape[1], DTYPE_SIZES[donor_ref.value_dtype]))
            held = registered.held_bytes(method, spec.batch_size, matches[matrix], *shapes, registered.CHUNK_BYTES)
            params = (("device", options.device), ("donor_rows", shapes[1][0]), ("held", held), ("matrix", matrix),
                      ("model_rows", shapes[0][0]), ("seed", options.random_seed),
                      ("source", f"{source}:{matches[matrix].digest()}"))
            shape = (matches[matrix].rows, ref.value_shape[1])
            tensors[name] = _tensor(name, registered.SURGERY_ROWS, (ref, donor_ref), params, shape, ref.value_dtype)
        elif is_head(name):
            raise UsageError(f"MODEL's {name} follows the vocabulary, and tokensurgeon remaps only the token "
                             "embedding and the head's weight")
        else:
            tensors[name] = _tensor(name, "passthrough", (ref,), (), ref.value_shape, ref.value_dtype,
                                    model_params=((("scale", None),),))
    options = resolve_shard_size(options, tensors)
    options, naming = output_naming(options, [f.name for f in model.files])
    shards, placed = assign_shards(tensors, options.out_shard_size, naming=naming)
    rows = matches["embed"].rows
    donor_dtype = donor.tensors[matrices.names["embed"][1]].entry.dtype
    written_config = out_config(model.config, donor.config, rows)
    wanted = adds.wanted if adds is not None and adds.changed else None  # None: what DONOR's tokenizer adds
    if wanted is not None:
        written_config = out_config_ids(written_config, wanted)
    set_quantization(written_config, model.config, placed)  # a GGUF MODEL's says what its tensors were
    # As a merge's: --out-type gguf writes one GGUF (or gguf-split's files) holding DONOR's tokenizer.
    container = container_for(options)
    tokenizer_donor = opened.donor_key if options.copy_tokenizer and not container.self_contained else None
    donor_rows = donor.tensors[matrices.names["embed"][1]].entry.shape[0]
    if container.self_contained and donor.gguf is not None and rows != donor_rows:
        # The file takes DONOR's GGUF vocabulary as it is; transformers' rebuild of it has other tokens.
        raise UsageError(f"a GGUF output holds DONOR's {donor_rows} GGUF tokens, but its tokenizer as transformers "
                         f"rebuilds it has {rows}", hint="write safetensors (the default --out-type)")
    blobs = (opened.tokenizer_files(opened.donor_key) if tokenizer_donor else None) or {}
    if wanted is not None and tokenizer_donor:  # MODEL's BOS (EOS) added by DONOR's tokens: the files say it
        blobs = rewritten(blobs or _folder_files(donor), wanted)
    parents = {opened.model_key: model, opened.donor_key: donor}
    keys: dict[str, str | bool | int] = {"general.name": gguf_name(spec)}
    if wanted is not None:
        keys.update(wanted.gguf_keys())
    shards, placed, container = place_files(container, shards, placed, Placing(
        written_config, parents, [opened.donor_key], unit_size=options.out_shard_size, gguf_keys=keys))
    plan = Plan(
        method=METHOD,
        tensors={n: placed[n] for n in sorted(placed)},
        shards=shards,
        donor=opened.model_key,
        tokenizer_donor=tokenizer_donor,
        num_layers=layer_count(model.config) or 0,
        layer_origins=(),
        inputs=_input_files(opened.inputs),
        model_dirs={k: str(m.directory) for k, m in opened.inputs.models.items()},
        options=options,
        out_config=written_config,
        tokenizer_files=tokenizer_hashes(opened.inputs.models, tokenizer_donor, blobs) if tokenizer_donor else (),
        tokenizer_blobs=blobs,
        container=container,
        notes=(*report_lines(spec, matches), *method_notes(method, donor_dtype), *_match_notes(spec),
               *_adds_notes(adds)),
        units=registered.UNITS,
        card_config=opened.config,
        card_method=("tokensurgeon", f"{spec.model} given {spec.donor}'s tokenizer; the rows of the tokens it "
                                     f"lacked approximated by {spec.describe()}", "https://arxiv.org/abs/2506.06607"),
        card_wording=card_wording(spec, opened, matches, options),
        config_copy=CONFIG_COPY,
    )
    return fingerprinted(replace(plan, extra_parts=own_parts(plan, opened)))


def gguf_name(spec: SurgerySpec) -> str:
    """A transplant's GGUF ``general.name``: MODEL's name with DONOR's tokenizer (each by the last part of its
    path or hub id, no revision or adapter)."""
    def name(ref: str) -> str:
        path = parse_model_ref(ref).path
        return path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") or ref

    return f"{name(spec.model)} with {name(spec.donor)}'s tokenizer"


def _folder_files(model: ModelInput) -> dict[str, bytes]:
    """The tokenizer files of a folder model, by name (a few MB at most: read once, held by the plan)."""
    directory = tokenizer_dir(model)
    return {name: (directory / name).read_bytes() for name, _ in tokenizer_files(directory)}


def _adds_notes(adds: OutputAdds | None) -> tuple[str, ...]:
    note = adds.note() if adds is not None else None
    return (note,) if note else ()


def own_parts(plan: Plan, opened: Opened) -> tuple[tuple[str, str], ...]:
    """The transplant's own fingerprint parts (:attr:`Plan.extra_parts`, named as
    :mod:`~resumerge.merge.plan.changes` tells them): its card's words and notes, which hold what the other parts
    leave out (``--allow-crimes`` in the card's command line), and each tokenizer file of MODEL and DONOR as a part
    of its own, so a refused resume names the file: both decide the match, the rows copied and the card's Tokens
    section, and neither is a weight file the inputs' identities cover (a GGUF's tokenizer is in its weight file)."""
    wording = asdict(plan.card_wording) if plan.card_wording is not None else None
    card = json.dumps([wording, plan.card_method, plan.notes], sort_keys=True)
    parts = [(CARD_PART, hashlib.sha256(card.encode()).hexdigest())]
    for key in (opened.model_key, opened.donor_key):
        model = opened.inputs.models[key].recognised(CODECS)
        if model.gguf is None:
            parts += [(f"{READ_PART}{key}/{name}", digest) for name, digest in tokenizer_files(tokenizer_dir(model))]
    return tuple(parts)


def output_flags(options: PlanOptions) -> tuple[str, ...]:
    """The flags of ``options`` that decide the output's bytes where they are not the defaults, as the command
    line gives them: the format (``--out-type gguf`` and its GGUF types and split), the shard size (an hf:// OUT's,
    which the planner picks, given as the size it picked so a folder OUT gets the same shards), the seed, the
    device, the threads and ``--allow-crimes``. Publishing (``--public``, the commit cadence) and resources
    (``--max-memory``, ``--state-dir``) change no output byte and are left out; so is any token."""
    default = PlanOptions()
    flags: list[str] = []
    if options.out_shard_size != default.out_shard_size:
        flags += ["--out-shard-size", str(options.out_shard_size)]
    if options.out_type != default.out_type:
        flags += ["--out-type", options.out_type]
        if options.gguf_type != default.gguf_type:
            flags += ["--gguf-type", options.gguf_type]
        if options.gguf_split_max_size is not None:
            flags += ["--gguf-split-max-size", str(options.gguf_split_max_size)]
        for rule in options.gguf_tensor_types:
            flags += ["--gguf-tensor-type", rule]
        if options.gguf_output_type is not None:
            flags += ["--gguf-output-type", options.gguf_output_type]
        if options.gguf_token_embedding_type is not None:
            flags += ["--gguf-token-embedding-type", options.gguf_token_embedding_type]
        for spec in options.gguf_override_kv:
            flags += ["--gguf-override-kv", spec]
        if options.gguf_pure:
            flags.append("--pure")
    if options.random_seed != default.random_seed:
        flags += ["--random-seed", str(options.random_seed)]
    if options.device != default.device:
        flags += ["--device", options.device]
    if options.num_threads is not None:
        flags += ["-j", str(options.num_threads)]
    if options.allow_crimes:
        flags.append("--allow-crimes")
    return tuple(flags)


def card_wording(spec: SurgerySpec, opened: Opened, matches: Mapping[str, MatrixMatch],
                 options: PlanOptions) -> CardWording:
    """The card of a transplant: titled by what was given whose tokenizer, each matrix's account of its tokens in
    a section of its own, MODEL and DONOR by their roles, the command line that makes it (``options``' output
    flags too), and the recorded options as the JSON they are."""
    lead = (f"{spec.model}'s weights with {spec.donor}'s tokenizer: a tokenizer transplant made with resumerge "
            "tokensurgeon (the options and meanings of mergekit-tokensurgeon 0.1.5). The token embedding and head "
            "rows of the tokens both vocabularies hold (the same bytes, however each tokenizer writes them) are "
            "MODEL's, copied bit for bit; the rows of DONOR's other "
            f"tokens are approximated from MODEL's rows by {spec.describe()}. Made by "
            f"`{spec.command(output_flags(options))}`.")
    return CardWording(
        title=f"{spec.model} with {spec.donor}'s tokenizer",
        lead=lead,
        method_heading="Transplant method",
        sections=(("Tokens", report_lines(spec, matches)),),
        roles=((opened.model_key, "MODEL: its weights"), (opened.donor_key, "DONOR: its tokenizer")),
        config_heading="Options",
        config_intro=f"The options of the transplant, as recorded with the run (and in `{CONFIG_COPY}`):",
        config_language="json",
        tags=("tokensurgeon",),
    )


def surgery_method(spec: SurgerySpec, opened: Opened, matrices: Matrices) -> Method:
    """The approximation the units run: the spec's options, and for ``mp_rope`` both models' rotary heads read
    from their configs (UsageError when a config names no head count or the width does not split into heads)."""
    rope = None
    if spec.approximation_method == "mp_rope":
        donor_width = opened.donor.tensors[matrices.names["embed"][1]].entry.shape[1]
        model_width = opened.model.tensors[matrices.names["embed"][0]].entry.shape[1]
        rope = (rope_of(opened.donor.config, donor_width, "DONOR"), rope_of(opened.model.config, model_width, "MODEL"))
    return Method(spec.approximation_method, spec.k, spec.cosine_similarity, spec.weight_scheme,
                  spec.subword_method, spec.new_vocab_noise, spec.new_vocab_scale, rope)


def rope_of(config: Mapping[str, Any], width: int, who: str) -> Rope:
    """A model's rotary heads from its config.json: ``num_attention_heads`` and the RoPE theta, from
    ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (transformers 5), 10000 where neither is
    given (transformers' default)."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0 or width % heads or (width // heads) % 2:
        raise UsageError(f"mp_rope needs {who}'s config.json to name num_attention_heads that cut its width "
                         f"{width} into heads of an even size, found {heads!r}",
                         hint="pass another --approximation-method")
    base = config.get("rope_theta")
    parameters = config.get("rope_parameters")
    if base is None and isinstance(parameters, Mapping):
        base = parameters.get("rope_theta")
    if base is None:
        base = 10000.0
    if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
        raise UsageError(f"mp_rope needs {who}'s RoPE theta to be a positive number, found {base!r}")
    return Rope(heads, float(base))


def out_config(model: Mapping[str, Any], donor: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """MODEL's config.json with the new vocabulary size and DONOR's special token ids (pad, eos and bos always,
    None when DONOR names none, as transformers' config objects carry them; the others where DONOR has them)."""
    out = dict(model)
    out["vocab_size"] = rows
    for key in _DONOR_KEYS:
        if key in donor or key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            out[key] = donor.get(key)
    return out


def report_lines(spec: SurgerySpec, matches: Mapping[str, MatrixMatch]) -> tuple[str, ...]:
    """What was done to each matrix: the log's, ``status``'s and the card's account."""
    label = {"embed": "token embedding", "lm_head": "head"}
    return tuple(f"tokensurgeon {label[m]}: {match.rows} rows, {match.report(spec.describe())}"
                 for m, match in matches.items())


def _match_notes(spec: SurgerySpec) -> tuple[str, ...]:
    notes = []
    if spec.magikarp:
        notes.append("--magikarp: MODEL lends only the rows of tokens both models trained well; DONOR tokens neither "
                     "trained well are left zero")
    if {spec.prefix_match, spec.byte_match} & {"embed", "lm_head"}:
        notes.append("--prefix-match/--byte-match embed and lm_head apply to the matrix they name "
                     "(mergekit-tokensurgeon 0.1.5 applies each to the other one)")
    return tuple(notes)


def _one(model: ModelInput, test: Callable[[str], bool], what: str, who: str) -> str:
    found = [n for n in model.tensors if test(n)]
    if len(found) != 1:
        listed = ", ".join(found) if found else "none"
        raise UsageError(f"{who} needs exactly one {what} tensor, found {listed}")
    return found[0]


def _head(model: ModelInput) -> str | None:
    heads = [n for n in model.tensors if is_head(n) and n.endswith(".weight")]
    if len(heads) > 1:
        raise UsageError(f"tokensurgeon needs at most one output head, found {', '.join(heads)}")
    return heads[0] if heads else None


def _tensor(name: str, method: str, inputs: tuple[InputRef, ...], params: tuple[tuple[str, object], ...],
            shape: tuple[int, ...], dtype: str,
            model_params: tuple[tuple[tuple[str, object], ...], ...] | None = None) -> TensorPlan:
    return TensorPlan(name=name, shard="", method=method, inputs=inputs, base_index=None,
                      model_params=model_params if model_params is not None else tuple(() for _ in inputs),
                      params=params, shape=shape, compute_dtype=None, out_dtype=dtype,
                      nbytes=numel(shape) * DTYPE_SIZES[dtype])


def _source_digest(opened: Opened, spec: SurgerySpec, matches: Mapping[str, MatrixMatch],
                   rope: tuple[Rope, Rope] | None) -> str:
    """A digest of the models' file identities and the approximation asked (a kept batch is never another's)."""
    files = _input_files(opened.inputs)
    text = repr((files.get(opened.model_key), files.get(opened.donor_key), spec.approximation_method, spec.k,
                 spec.cosine_similarity, spec.weight_scheme, spec.subword_method, spec.batch_size,
                 spec.new_vocab_noise, spec.new_vocab_scale, rope))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _input_files(inputs: Inputs) -> dict[str, tuple[tuple[str, int, str], ...]]:
    return {key: tuple((f.name, f.size, f.identity) for f in m.files) for key, m in sorted(inputs.models.items())}

