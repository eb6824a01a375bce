"""Every decoder-only text family the installed transformers ships, each as a tiny model built the way transformers
builds it: the config class's defaults with their sizes shrunk (four layers, hidden 32, vocabulary 512, a few
experts), ``AutoModelForCausalLM.from_config``, norms perturbed, ``save_pretrained``. A family is in the census when
transformers builds it, runs a forward on the CPU and reloads what it saved; :data:`SKIPPED` names, with the reason,
each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that is not (an encoder-decoder, a model of several
sub-models, one that needs a GPU kernel). A new transformers release's new family is built here with no line
written for it, so the census tests (tests/test_census.py) name it when resumerge cannot merge, slice or check it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

LAYERS = 4
VOCAB = 512
# token ids of three texts of lengths that put padding beside real positions in a batch
TEXTS = [[(7 * i * (n + 1) + 3) % (VOCAB - 3) + 3 for i in range(n)] for n in (30, 17, 9)]
# the size keys of transformers' config classes, shrunk: a key is set only where the class's defaults hold it
SMALL: Mapping[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "n_routed_experts": 4, "num_experts": 4,
    "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 256, "n_inner": 64, "d_model": 32,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4, "first_k_dense_replace": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "sliding_window": 16, "global_head_dim": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input":
    VOCAB, "num_kv_shared_layers": 0, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 8,
    "mamba_d_head": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 1, "mamba_n_groups": 1,
    "state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8, "top_k_experts": 2, "ffn_hidden_size": 64,
    "rotary_dim": 4, "partial_rotary_factor": 0.5, "use_mamba_kernels": False, "use_cache": True,
    "attention_chunk_size": 16, "intermediate_size_mlp": 48, "num_shared_experts": 1, "shared_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16, "embedding_size": 32, "block_size": 16, "num_layers": LAYERS,
    "n_layers": LAYERS, "decoder_layers": LAYERS,
}
# Inkling's sliding-window layers' heads (its defaults: 48 or 64 heads of 128), shrunk as the table shrinks the others
_SWA: Mapping[str, Any] = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8}
# families that need a size the shared table cannot give (a head count its defaults tie to another key)
OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8},
    "mamba2": {"num_heads": 8, "head_dim": 8},
    "zaya": {"num_experts_per_tok": 1},
    # its defaults' experts are 2,048 wide, twelve of them routed to among 256 zero experts: transformers' own
    # conversion of them does not end in minutes here
    "longcat_flash": {"expert_ffn_hidden_size": 16, "zero_expert_num": 2, "moe_topk": 2},
    # its cache rounds the key and value widths up to a multiple of 64 where its layers do not: transformers' own
    # forward with a cache (its config's use_cache) runs only where hidden_size times qk_dim_factor is one
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # its width is emb_dim, its heads n_heads (no size key of the table): its defaults' 2,048 wide layers made a
    # model of 200M weights, the census's slowest build by far
    # (causal: its decoder mode, as BERT's census model is built with is_decoder; its defaults' and published
    # checkpoints' causal false is a masked LM, whose check is refused naming why)
    "xlm": {"emb_dim": 32, "n_heads": 4, "causal": True},
    # (its causal mode, uni; its defaults' and published checkpoints' bi attends both ways: check refused)
    "xlnet": {"attn_type": "uni"},
    # widths of their own names, no size key of the table, that its defaults keep thousands wide (each family's
    # census row took 2 to 8 times a Llama's)
    "inkling_text": _SWA,
    "gemma3n_text": {"intermediate_size": [64] * LAYERS},  # (one per layer: a list)
    "cpmant": {"dim_ff": 64, "dim_head": 8},
    "ctrl": {"dff": 64},
    # its shape and pronunciation embeddings' 24,858 and 910 rows are tables of their own, no size key
    "roc_bert": {"shape_vocab_size": 64, "shape_embed_dim": 16, "pronunciation_vocab_size": 64,
                 "pronunciation_embed_dim": 16},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    # hybrids whose first four layers, as their defaults place them, hold no attention layer: one every other layer
    "bamba": {"attn_layer_indices": [1, 3]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # (its layer_types in transformers' own terms: one per layer, not its config.json's attention and MLP blocks)
    "dory": {"n_input_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    # a head of fewer rows than the embedding (the census's texts hold ids under it: :func:`texts_of`), and a block of
    # two layers (its defaults' six: the block states then hold the embeddings alone in four layers)
    "inkling2_text": {"unpadded_vocab_size": VOCAB - 12, "n_layers_per_attn_res_block": 2, **_SWA},
    # and its loop on (its defaults loop layers 6 to 17, none of four): layers 2 and 3 run twice
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB - 12, "n_layers_per_attn_res_block": 2,
                           "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, **_SWA},
    # (its LSH attention hashes with rotations each forward draws at random unless hash_seed fixes them: transformers'
    # own NLL is then no function of its weights alone)
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh", "local", "lsh"], "axial_pos_shape": [16, 16],
                 "axial_pos_embds_dim": [16, 16], "attention_head_size": 8, "feed_forward_size": 64,
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 4, "hash_seed": 7},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                       "indexer_compress_ratio": 4, "hc_lowrank": 8, "ple_embed_dim": 32,
                       "ngram_vocab_size_base": 1000, "split_ngram_parts": 4, "heads_per_ngram": 2,
                       "layer_types": ["linear_attention", "indexed_attention", "linear_attention",
                                       "indexed_attention"]},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"], "mamba_d_state": 8,
              "n_mamba_heads": 2},
}

# the families transformers 5.24 builds, runs on the CPU and reloads from the shrunk defaults (:func:`built`)
CENSUS: tuple[str, ...] = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bamba", "beam", "bert",
    "bert-generation", "big_bird", "biogpt", "bitnet", "bloom", "camembert", "codegen", "cohere", "cohere2",
    "cohere2_moe", "cpmant", "ctrl", "cwm", "data2vec-text", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v4", "diffllama", "doge", "dory", "dots1", "electra", "ernie", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "falcon", "falcon_h1", "falcon_mamba", "flex_olmo", "flint", "gemma", "gemma2",
    "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj",
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium",
    "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text",
    "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kolibri1", "laguna",
    "lara_mini", "lfm2", "lfm3", "llama", "llama4_text", "longcat_flash", "mamba", "mamba2", "megatron-bert",
    "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3",
    "mistral", "mixtral", "modernbert-decoder", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text", "recurrent_gemma", "reformer",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "rwkv", "sarvam_mla", "sarvam_moe",
    "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "trocr", "vaultgemma", "xglm", "xlm",
    "xlm-roberta", "xlm-roberta-xl", "xlnet", "xlstm", "youtu", "zamba", "zamba2", "zaya",
)

# model types with a causal-LM class that are not in the census: an encoder-decoder or a model of sub-models (its
# text model, where transformers has one, is in the census)
COMPOSITE: tuple[str, ...] = (
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "blt", "dots3_note", "emu3", "fuyu",
    "gemma3", "gemma3n", "gemma4", "gemma4_unified", "gemma4_unified_assistant", "git", "got_ocr2", "llama4",
    "marian", "mbart", "mllama", "moshi", "moss_transcribe_diarize", "musicgen", "musicgen_melody", "mvp",
    "pegasus", "phi4_multimodal", "plbart", "prophetnet", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "whisper",
)
# model types whose shrunk defaults transformers does not build or run (tests built by hand hold some)
NOT_BUILT: Mapping[str, str] = {
    "bailing_hybrid": "its linear attention's head size comes out 0 from the shrunk sizes",
    "cohere_compass_text": "its rope parameters name no full_attention layer type",
    "dbrx": "its attention sub-config's defaults have no rope_theta",
    "dots3_note_text": "its per-layer head overrides cannot be shrunk with its heads",
    "gemma4_assistant": "a draft model for a Gemma 4 (no model of its own)",
    "kimi_linear": "its linear_attn_config is no size key (tests/family_table.py builds it)",
    "lfm2_moe": "its dense-layer count is no size key (tests/newest_families.py builds it)",
    "xmod": "its forward needs a language set first",
}


def model_types() -> list[str]:
    """Every model type transformers has a causal-LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """``model_type``'s config: its class's defaults, each size key they hold shrunk (:data:`SMALL`)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**copy.deepcopy(_tiny_kwargs(model_type)))


@cache
def _tiny_kwargs(model_type: str) -> dict[str, Any]:
    """What :func:`tiny_config` gives ``model_type``'s config class, worked out from the class's defaults once per
    process: a row asks for its config three times (each model, then its texts), and each default config built and
    validated cost as much as the config itself (copied per call: a class may keep a list it is given)."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in defaults}
    if "kv_lora_rank" in defaults:  # multi-head latent attention: as many key/value heads as query heads
        kwargs["num_key_value_heads"] = SMALL["num_attention_heads"]
    count = defaults.get("num_hidden_layers", defaults.get("n_layer"))
    for key, value in defaults.items():  # the per-layer lists and maps of the defaults, cut to the first layers
        if isinstance(value, list) and len(value) == count and key != "architectures":
            kwargs[key] = value[:LAYERS]
        elif key == "per_layer_config" and isinstance(value, dict):
            kwargs[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
    kwargs.update({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    kwargs.update(OVERRIDES.get(model_type, {}))
    return kwargs


def make_census_model(directory: Path, model_type: str, seed: int) -> Path:
    """Save a tiny random ``model_type`` model (weights drawn under ``seed``, norms perturbed) into ``directory``."""
    import torch
    from support import perturb_vectors
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    perturb_vectors(model, seed)
    model.save_pretrained(directory)
    return directory


@cache
def built(model_type: str, root: str) -> str | None:
    """Why transformers does not build, run on the CPU and reload a tiny ``model_type`` model (None: it does)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type)
        parts = set(getattr(config, "sub_configs", None) or ()) - {"attn_config", "ffn_config"}  # (DBRX's, MPT's)
        if config.is_encoder_decoder or parts:
            return "not a decoder-only text model"
        if getattr(config, "num_hidden_layers", LAYERS) != LAYERS and getattr(config, "n_layer", LAYERS) != LAYERS:
            return "its layer count is not a config key"
        directory = make_census_model(Path(root) / model_type, model_type, 0)
        reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            reloaded(input_ids=torch.tensor([[1, 5, 9, 2, 77]]), use_cache=False)
    except Exception as error:  # any failure of transformers' own: not a family of the census
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return None


def config_doc(directory: Path) -> dict[str, Any]:
    """The config.json at ``directory``."""
    found: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return found


def read_back(directory: Path) -> tuple[Any, dict[str, Any]]:
    """transformers' model of ``directory`` in float32, and its loading info."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


def config_as_read(directory: Path) -> dict[str, Any]:
    """The config transformers reads from ``directory``, less what names the folder or the writer."""
    from transformers import AutoConfig

    doc: dict[str, Any] = AutoConfig.from_pretrained(directory).to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"):
        doc.pop(key, None)
    return doc


def not_loaded(info: Mapping[str, Any]) -> dict[str, Any]:
    """The keys transformers could not place (missing, unexpected, mismatched): empty for a complete model."""
    return {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}


def _line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def texts_of(model_type: str) -> list[list[int]]:
    """:data:`TEXTS` as ``model_type``'s head scores them: each id under its rows (Inkling 2's head holds its
    unpadded vocabulary's rows, fewer than its embedding's), the first three (pad, bos, eos) never taken."""
    rows = getattr(tiny_config(model_type), "unpadded_vocab_size", None) or VOCAB
    return [[(t - 3) % (rows - 3) + 3 for t in ids] for ids in TEXTS]


def check_row(out: Path, texts: list[list[int]], journal: Path, reference: Any = None) -> str:
    """The census row's ``check`` of the model in ``out``: ``ok`` where its NLL over ``texts`` is transformers' own
    to 1e-4, else what went wrong, in one line: ``reference crash: …`` where transformers' own forward fails (not
    resumerge's failure), ``refused: …``, ``crash: …``, or how far the NLL is off. ``reference``: transformers' model
    of ``out`` (float32) where the row read it back already, else loaded here."""
    from newest_check import checked_nll, unpadded_nll

    from resumerge.errors import ResumergeError

    try:
        want = unpadded_nll(out, texts, reference)
    except Exception as error:  # transformers' own failure, not resumerge's
        return f"reference crash: {_line(error)}"
    try:
        got = checked_nll(out, texts, journal)
    except ResumergeError as error:
        return f"refused: {_line(error)}"
    except Exception as error:  # a crash is the census's news: one line, the rest still run
        return f"crash: {_line(error)}"
    off = abs(got - want)
    return "ok" if off <= 1e-4 else f"NLL off transformers' by {off:.1e} ({got:.5f}, {want:.5f})"


def census_row(model_type: str, root: Path) -> dict[str, str]:
    """What resumerge does with two tiny ``model_type`` models under ``root``: ``linear`` (a 0.5/0.5 merge: every
    tensor the mean, the config transformers reads the inputs', every weight placed), ``slices`` (a[0, 2) +
    b[2, 4): transformers places every weight), ``check`` (its NLL of the linear merge against transformers'
    own, each text alone; ``reference crash: …`` where transformers' own forward fails); each ``ok`` or what went
    wrong in one line."""
    import torch
    from support import api_merge, output_tensors

    from resumerge.errors import ResumergeError

    unrun = {a: said for a, said in OPEN.get(model_type, {}).items() if said.startswith("not run")}
    if set(unrun) == set(ASPECTS):
        return dict(unrun)
    a, b = make_census_model(root / "a", model_type, 1), make_census_model(root / "b", model_type, 2)
    row: dict[str, str] = {}
    out: Path | None = None
    reference = None  # transformers' model of the linear merge, read back once: the check row's reference too
    try:
        out = api_merge(root / "linear", {"merge_method": "linear", "dtype": "float32", "models": [
            {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]})
        ta, tb, merged = output_tensors(a), output_tensors(b), output_tensors(out)
        wrong = sorted(set(ta) ^ set(merged)) + [n for n in sorted(ta) if n in merged and not torch.equal(
            merged[n], 0.5 * ta[n] + 0.5 * tb[n])]
        before, after = config_as_read(a), config_as_read(out)
        changed = {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
                   if before.get(k) != after.get(k)}
        reference, info = read_back(out)
        missing = not_loaded(info)
        row["linear"] = ("ok" if not (wrong or changed or missing) else
                         f"tensors {wrong[:2]}, config {changed}, not loaded {missing}")
    except ResumergeError as error:
        row["linear"] = f"refused: {_line(error)}"
    except Exception as error:  # a crash is the census's news: one line, the rest still run
        row["linear"] = f"crash: {_line(error)}"
    try:
        sliced = api_merge(root / "slices", {"merge_method": "passthrough", "dtype": "float32", "slices": [
            {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
            {"sources": [{"model": str(b), "layer_range": [2, 4]}]}]})
        missing = not_loaded(read_back(sliced)[1])
        row["slices"] = "ok" if not missing else f"not loaded {missing}"
    except ResumergeError as error:
        row["slices"] = f"refused: {_line(error)}"
    except Exception as error:  # a crash is the census's news: one line, the rest still run
        row["slices"] = f"crash: {_line(error)}"
    if out is not None:
        row["check"] = check_row(out, texts_of(model_type), root / "journal", reference)
    return row


# What does not work yet, by family and aspect: the start of what the census row says (``not run: …``: the aspect is
# not run, it would not end). tests/test_census.py fails for a family that does other than this.
NLL = "NLL off transformers' by"
OPEN: Mapping[str, Mapping[str, str]] = {
    "hrm_text": {"slices": "refused: ConfigError: slices[0].sources[0].model: "},
    "xlm": {"slices": "keeps its layers' parts in separate numbered lists (transformer.attentions, transformer.ffns, "
                      "transformer.layer_norm1, transformer.layer_norm2), not one list of decoder layers"},
}
# the 2026 families by their names, with the model types transformers gives them
NAMED: Mapping[str, tuple[str, ...]] = {
    "DeepSeek-V4": ("deepseek_v4",), "Qwen3.5 / Qwen3.6": ("qwen3_5_text", "qwen3_5_moe_text"),
    "Qwen4-exp": ("qwen4_exp_text",), "Kimi K2.6 (its language model: DeepSeek-V3's layout)": ("deepseek_v3",),
    "MiniMax M2.5": ("minimax_m2",), "MiniMax M3": ("minimax_m3_vl_text",),
    "Granite 4 / 4.1": ("granitemoehybrid", "granite"), "Hunyuan v3 / v4": ("hy_v3", "hy_v4"),
    "Inkling": ("inkling_text", "inkling2_text", "inkling2_loop_text"), "Zaya": ("zaya",),
    "LongCat-Flash": ("longcat_flash",), "GLM-5": ("glm_moe_dsa",), "DeepSeek-V3.2": ("deepseek_v32",),
    "Gemma 4": ("gemma4_text",),
}
ASPECTS = ("linear", "slices", "check")
BEGIN, END = "<!-- census: begin -->", "<!-- census: end -->"


def _status(model_type: str) -> str:
    open_ = OPEN.get(model_type, {})
    return ", ".join(f"{a} {'no: ' + open_[a] if a in open_ else 'yes'}" for a in ASPECTS)


def census_markdown() -> str:
    """docs/supported.md's family table, made from :data:`CENSUS`, :data:`OPEN` and :data:`NAMED`."""
    import transformers

    counts = ", ".join(f"{a} {sum(a not in OPEN.get(t, {}) for t in CENSUS)}/{len(CENSUS)}" for a in ASPECTS)
    lines = [BEGIN, "", f"## Every decoder family of transformers {transformers.__version__}", "",
             "Each decoder-only text family transformers ships is built tiny from its config class's defaults, "
             "merged (linear 0.5/0.5), sliced (a[0, 2) + b[2, 4)) and checked (`check`'s NLL against "
             f"transformers' own) by tests/test_census.py: {len(CENSUS)} families, {counts}. This table is "
             "written by `python tests/census.py`.", ""]
    lines += [f"- {name}: " + "; ".join(f"`{t}` {_status(t)}" for t in types) for name, types in NAMED.items()]
    done = [t for t in CENSUS if t not in OPEN]
    lines += ["", "Merged, sliced and checked: " + ", ".join(f"`{t}`" for t in done) + ".", "",
              "Not all yet:", ""]
    lines += [f"- `{t}`: " + "; ".join(f"{a}: {said}" for a, said in OPEN[t].items()) for t in sorted(OPEN)]
    lines += ["", "Not in the census: encoder-decoders and models of sub-models (their text models are in it: "
              + ", ".join(f"`{t}`" for t in COMPOSITE) + "), and " + ", ".join(
                  f"`{t}` ({why})" for t, why in NOT_BUILT.items()) + ".", "", END]
    return "\n".join(lines) + "\n"


def _write_doc(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    block = census_markdown()
    text = text[:start] + block + text[end + len(END) + 1:] if start >= 0 and end >= 0 else text + "\n" + block
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":  # python tests/census.py [run OUT.json [MODEL_TYPE ...]]
    import sys
    import tempfile
    import warnings

    warnings.simplefilter("ignore")
    if sys.argv[1:2] != ["run"]:
        _write_doc(Path(__file__).resolve().parents[1] / "docs" / "supported.md")
        sys.exit(0)
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    found = Path(sys.argv[2])
    rows = json.loads(found.read_text()) if found.exists() else {}
    for model_type in sys.argv[3:] or CENSUS:
        with tempfile.TemporaryDirectory() as root:
            try:
                rows[model_type] = census_row(model_type, Path(root))
            except Exception as error:  # a crash is the census's news too
                rows[model_type] = {"crash": _line(error)}
        print(model_type, rows[model_type], flush=True)
        found.write_text(json.dumps(rows, indent=1, sort_keys=True))
    print(", ".join(f"{a} {sum(r.get(a) == 'ok' for r in rows.values())}/{len(rows)}" for a in ASPECTS))
