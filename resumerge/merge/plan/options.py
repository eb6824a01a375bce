"""The options of a plan that change its output's bytes (:class:`PlanOptions`): the engine's settings a run records
with its plan and fingerprints, which options came later (:data:`LATER_OPTIONS`: not fingerprinted at their default,
so an older run resumes as planned) and which name a file of this machine (:data:`PATH_OPTIONS`: recorded by their
bytes' digest). Re-exported by :mod:`resumerge.merge.plan.merge_plan`, the plan they belong to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from resumerge.merge.plan.defaults import DEFAULT_SEED, DEFAULT_SHARD_SIZE


@dataclass(frozen=True)
class PlanOptions:
    """Command-line options that change output bytes (and so belong in the fingerprint)."""

    out_shard_size: int = DEFAULT_SHARD_SIZE
    random_seed: int = DEFAULT_SEED
    copy_tokenizer: bool = True
    # Lets models of different architectures be planned (mergekit's --allow-crimes). Recorded with the run so a
    # resume plans the same way, but left out of the fingerprint: it changes no output byte.
    allow_crimes: bool = False
    # Where methods run ("cpu" or "cuda:N"): a GPU may round differently, so it is part of the output's identity.
    device: str = "cpu"
    # --stream-inputs: read every hub input by HTTP Range (else each file's choice is automatic, see
    # merge/plan/fetching.py). Recorded so a resume streams too; out of the fingerprint: it changes no output byte.
    stream_inputs: bool = False
    # --no-write-model-card: no README.md and no mergekit_config.yml in OUT, as mergekit.
    write_model_card: bool = True
    # --unsafe-truncate-embeddings: vocabulary tensors of different lengths keep their common leading rows.
    unsafe_truncate_embeddings: bool = False
    # -j/--num-threads, kept only when a method of the plan is thread_dependent (the planner drops it otherwise,
    # so it never changes the fingerprint of a plan whose bytes do not depend on it); None: torch's choice.
    num_threads: int | None = None
    # --dequantize: every output tensor stored plainly in its dtype (no quantized format, no companions).
    dequantize: bool = False
    # Output shards numbered like the parent's (sharding.py's output_naming); False (transformers naming) is what a
    # run recorded before it resumes with; every new run asks it, dropped where the names would not change.
    parent_shard_names: bool = False
    # --out-type gguf: one GGUF file (llama.cpp's layout), its matrices as --gguf-type; else safetensors shards.
    out_type: str = "safetensors"
    gguf_type: str = "f16"
    # --gguf-tensor-type, --gguf-output-type, --gguf-token-embedding-type: llama-quantize's; --imatrix: llama.cpp's
    # matrix file, or with --imatrix-texts where the run writes the one it computes on the merge; paths of this
    # machine, never fingerprinted nor published: their bytes' digests are (PATH_OPTIONS).
    gguf_tensor_types: tuple[str, ...] = ()
    gguf_output_type: str | None = None
    gguf_token_embedding_type: str | None = None
    imatrix: str | None = None
    imatrix_texts: str | None = None
    imatrix_sha256: str | None = None
    imatrix_texts_sha256: str | None = None
    # --gguf-override-kv and --pure (llama-quantize's); --gguf-tensor-type-file's pairs are in gguf_tensor_types.
    gguf_override_kv: tuple[str, ...] = ()
    gguf_pure: bool = False
    # --gguf-target-size (file bytes) / --gguf-target-bpw, and the NAME=type pairs chosen for it (ggufbudget.py).
    gguf_target_size: int | None = None
    gguf_target_bpw: float | None = None
    gguf_chosen_types: tuple[str, ...] = ()
    # --gguf-split-max-size: gguf-split's files of at most this many tensor bytes each (None: one file, model.gguf).
    gguf_split_max_size: int | None = None
    # --out-adapter: a factor merge (core_space) written as a merged PEFT adapter instead of a merged model.
    out_adapter: bool = False

    def __post_init__(self) -> None:  # recorded options are JSON, a tuple a list: [] != () changed the fingerprint
        for name in ("gguf_tensor_types", "gguf_override_kv", "gguf_chosen_types"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


# Options added after runs were first recorded: not fingerprinted at their default (an older run resumes as planned).
LATER_OPTIONS: Mapping[str, object] = MappingProxyType({
    "write_model_card": True, "unsafe_truncate_embeddings": False, "num_threads": None, "dequantize": False,
    "parent_shard_names": False, "out_type": "safetensors", "gguf_type": "f16", "gguf_tensor_types": (),
    "gguf_output_type": None, "gguf_token_embedding_type": None, "imatrix": None, "imatrix_texts": None,
    "gguf_split_max_size": None, "out_adapter": False, "gguf_override_kv": (), "gguf_pure": False,
    "imatrix_sha256": None, "imatrix_texts_sha256": None, "gguf_target_size": None, "gguf_target_bpw": None,
    "gguf_chosen_types": (),
})
# Options naming a file of the machine that runs: recorded by its digest (NAME_sha256) and base name (changes.py).
PATH_OPTIONS = ("imatrix", "imatrix_texts")
