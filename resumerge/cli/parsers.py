"""Every command's argument parser, built per command: a command line that starts with a command is parsed by that
command's parser alone (:func:`build_parser`), so ``resumerge status OUT`` builds, and imports, nothing of the other
commands' (issue 72: status under 0.2 s, most of it the interpreter's start).

Used by :mod:`resumerge.cli.commands` (and the docs test); options become API keyword arguments there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resumerge.cli import flags
from resumerge.config import analyses
from resumerge.config.passplace import named
from resumerge.config.version import __version__

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of every command (the docs test, ``resumerge --help``), or, when ``command`` names one
    (:func:`commands`), a parser holding that command's alone: a command line that starts with a command is parsed
    by that command's parser only, so ``resumerge status OUT`` builds (and imports) nothing for the other twelve.
    Either way a command's parser, and its ``--help``, are the same (tests/test_cli_lazy.py)."""
    parser = argparse.ArgumentParser(
        prog="resumerge",
        description="Crash-safe, resumable merges of LLM weights from mergekit YAML configs.",
    )
    parser.add_argument("--version", action="version", version=f"resumerge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    every = commands()
    for name, each in every.items():  # in the order `resumerge --help` lists them
        if command not in every or command == name:
            if isinstance(each.parser, str):
                _add_declared(sub, name, each.parser)
            else:
                each.parser(sub)
    return parser


def _add_declared(sub: SubParsers, name: str, module: str) -> None:
    """The parser of the command ``name`` that ``module`` declares, imported only when that parser is built: its
    ``HELP`` (its line in ``resumerge --help``), ``DESCRIPTION`` (its ``--help``'s opening) and
    ``add_arguments(parser)`` (every argument and flag it takes); ``ADD_HELP = False`` where its ``--help`` is not
    argparse's (``lm-eval``'s is lm-eval's)."""
    declared = importlib.import_module(module)
    declared.add_arguments(sub.add_parser(name, help=declared.HELP, description=declared.DESCRIPTION,
                                          add_help=getattr(declared, "ADD_HELP", True)))


def _run_parser(sub: SubParsers) -> None:
    from resumerge.cli.ignoredflags import UNNEEDED_FLAGS, UNNEEDED_WITH_VALUE, accept_ignored

    run = sub.add_parser("run", help="merge CONFIG into OUT (continues an unfinished run of the same config)",
                         description="Merge a mergekit YAML config into OUT. Interrupted runs continue "
                                     "where they stopped; output is byte-identical to an uninterrupted run.")
    run.add_argument("config", metavar="CONFIG", help="mergekit YAML config")
    run.add_argument("out", metavar="OUT", help="output directory (created; must be empty or resumerge's), or a hub "
                                                 "repo hf://NAMESPACE/NAME[@BRANCH]")
    _common(run)
    flags.add_executor(run)
    _keep_flag(run)
    _merge_flags(run)
    flags.add(run, flags.RESTART, flags.PUBLIC)
    run.add_argument("--check", action="store_true", help="then check the merge as resumerge check does; exit "
                     "with the check's code (0 works, 5 no effect, 6 broken)")
    run.add_argument("--no-write-model-card", action="store_false", dest="write_model_card",
                     help="write no README.md model card and no mergekit_config.yml")
    run.add_argument("--out-adapter", action="store_true",
                     help="merge_method core_space: write the merged LoRA adapters as one PEFT adapter (rank at "
                          "most their summed ranks) instead of a merged model")
    flags.add(run, flags.DEVICE, flags.CUDA, flags.TRANSFORMERS_CACHE)
    run.add_argument("--cleanup-intermediates", action="store_true",
                     help="recipes: delete the named stages' outputs once the final output is verified")
    accept_ignored(run, UNNEEDED_FLAGS, UNNEEDED_WITH_VALUE)


def _merge_flags(p: argparse.ArgumentParser) -> None:
    """What a merge of CONFIG is beside the config itself (its shards, seed, tokenizer, vocabularies, output type,
    crimes and reads): the flags of run, and of plan, which estimates that run with the same words."""
    p.add_argument("--out-shard-size", default=None, metavar="SIZE",
                   help="bytes per output shard (k/M/B = 1e3/1e6/1e9, or KiB/MiB/GiB) [default: 1B; for an "
                        "hf:// OUT, whose shards upload while the next are merged, about 1/100 of the output, "
                        "25M to 5B]; an interruption costs at most one shard of work (--out-type gguf: "
                        "the most bytes of one unit of the file, written in place in a local OUT)")
    p.add_argument("--random-seed", type=int, default=0, metavar="N",
                   help="seed of randomised methods (drawn per tensor, so resume is exact) [default: 0]")
    p.add_argument("--no-copy-tokenizer", action="store_false", dest="copy_tokenizer",
                   help="do not copy tokenizer files")
    p.add_argument("--unsafe-truncate-embeddings", action="store_true",
                   help="merge models whose vocabularies differ in size by keeping the common leading rows of "
                        "embeddings and heads (vocab_size and the tokenizer are cut to match)")
    p.add_argument("--dequantize", action="store_true",
                   help="store every output tensor unquantized in its dtype, with no quantization_config "
                        "[default: the output keeps the base model's quantized format]")
    _out_type_flags(p)
    p.add_argument("--allow-crimes", action="store_true",
                   help="merge models of different architectures, tensor by tensor as names and shapes allow")
    p.add_argument("--i-understand-this-is-not-useful-without-training", action="store_true",
                   dest="allow_same_experts",
                   help="mergekit-moe configs: let every expert be the same model (as mergekit-moe does)")
    p.add_argument("--stream-inputs", action="store_true",
                   help="read every hub input's tensors by HTTP Range instead of downloading files [default: "
                        "download into the HF cache in the order the merge reads, merging as the bytes land; "
                        "stream a file the merge needs less than half of, or that --max-disk has no room for]")
    p.add_argument("--intermediate-dir", "-I", metavar="DIR",
                   help="recipes (several YAML documents): where named stages are written, one folder each "
                        "[default: OUT.intermediates beside OUT; for hf:// OUT, in the state dir]")


def _resume_parser(sub: SubParsers) -> None:
    resume = sub.add_parser("resume", help="finish the merge recorded for OUT",
                            description="Finish an interrupted merge. Works from OUT alone when the state dir "
                                        "is gone (the ledger is rebuilt from OUT's manifest).")
    resume.add_argument("out", metavar="OUT", help="output directory of the interrupted merge, or its hub repo "
                                                    "hf://NAMESPACE/NAME[@BRANCH] (resumes from the repo alone "
                                                    "when the state dir is gone)")
    _common(resume)
    flags.add_executor(resume)
    _keep_flag(resume)
    resume.add_argument("--cleanup-intermediates", action="store_true",
                        help="recipes: delete the named stages' outputs once the final output is verified")


def _status_parser(sub: SubParsers) -> None:
    status = sub.add_parser("status", help="show where the merge into OUT (or the search in STORAGE) stands",
                            description="Show the state of a merge (fast: reads the ledger only).")
    status.add_argument("out", metavar="OUT", help="output directory of the merge (or recipe), or its hub repo "
                                                    "hf://NAMESPACE/NAME[@BRANCH]")
    flags.add(status, flags.STATE_DIR)
    status.add_argument("--json", action="store_true", help="print JSON")


def _verify_parser(sub: SubParsers) -> None:
    verify = sub.add_parser("verify", help="re-hash OUT's files against their recorded checksums",
                            description="Check every committed output file against its recorded checksum "
                                        "(xxh3-128 in a folder, sha256 in a hub repo and in records made before); "
                                        "name damaged files (exit 3: resume repairs them).")
    verify.add_argument("out", metavar="OUT", help="output directory of the merge, or its hub repo "
                                                    "hf://NAMESPACE/NAME[@BRANCH]")
    flags.add(verify, flags.STATE_DIR)
    verify.add_argument("--json", action="store_true", help="print JSON")


def _out_type_flags(p: argparse.ArgumentParser, *, importance: bool = True) -> None:
    """The output's format flags of run and tokensurgeon: --out-type, the GGUF output's type and split (and the
    importance matrix flags where ``importance``)."""
    out_format_flags(p)
    p.add_argument("--gguf-split-max-size", metavar="SIZE",
                   help="--out-type gguf: write gguf-split's files model-00001-of-0000N.gguf of at most SIZE "
                        "tensor bytes each (e.g. 2GB; llama.cpp loads the first) [default: one model.gguf]")
    _gguf_type_flags(p.add_argument, importance=importance)


def out_format_flags(p: argparse.ArgumentParser) -> None:
    """--out-type and --gguf-type: run's, and evolve's for --merge-best."""
    from resumerge.config.outformats import out_types
    from resumerge.merge.plan.defaults import GGUF_TYPES

    p.add_argument("--out-type", choices=out_types(), default="safetensors",
                   help="write the output as safetensors shards, or as one GGUF file llama.cpp loads (its "
                        "tokenizer from a GGUF parent) [default: safetensors]")
    # no argparse choices: the API takes llama.cpp's spelling (Q4_K_M) as its own, and refuses another in one line
    p.add_argument("--gguf-type", metavar="TYPE", default="f16",
                   help=f"--out-type gguf: how matrices are stored, one of {', '.join(GGUF_TYPES)} (either case): a "
                        "type or one of llama-quantize's K-quant and i-quant mixes (q4_k_m, iq4_xs, iq3_m, iq2_m "
                        "...: each tensor's type as llama-quantize picks it, its bytes as llama.cpp's quantizer "
                        "writes them; q2_k_s, iq3_xs, iq3_xxs and the iq2 and iq1 mixes need an importance matrix; "
                        "mxfp4_moe: experts MXFP4, the rest Q8_0; tq1_0 and tq2_0 keep only ternary weights exactly, "
                        "for BitNet-like parents); norms and 1-D tensors are F32. A comma list (q8_0,q6_k,q4_k_m) "
                        "writes a release: one file per type, NAME-Q4_K_M.gguf (NAME: the config's name:, else "
                        "model), each the bytes of a run of its type alone, from one merge of each tensor "
                        "[default: f16]")


def _gguf_type_flags(add: Callable[..., Any], *, importance: bool = True) -> None:
    """The GGUF output's type flags of run and plan (llama-quantize's, under the --gguf- prefix; its importance
    matrix where ``importance``)."""
    add("--gguf-tensor-type", action="append", dest="gguf_tensor_types", metavar="PATTERN=TYPE",
        help="--out-type gguf: tensors whose GGUF name matches the regular expression PATTERN get TYPE "
             "(llama-quantize's --tensor-type; repeatable, the first match wins)")
    add("--gguf-output-type", metavar="TYPE",
        help="--out-type gguf: the type of output.weight (llama-quantize's --output-tensor-type)")
    add("--gguf-token-embedding-type", metavar="TYPE",
        help="--out-type gguf: the type of token_embd.weight (llama-quantize's --token-embedding-type)")
    add("--gguf-tensor-type-file", metavar="FILE",
        help="--out-type gguf: FILE's PATTERN=TYPE pairs (white-space separated), after --gguf-tensor-type's "
             "(llama-quantize's --tensor-type-file)")
    add("--gguf-override-kv", action="append", metavar="KEY=TYPE:VALUE",
        help="--out-type gguf: write the key-value KEY (TYPE int, float, bool or str) over the one resumerge "
             "writes (llama-quantize's --override-kv; repeatable)")
    add("--pure", action="store_true", dest="gguf_pure",
        help="--out-type gguf: no mix rules: every matrix the --gguf-type's default type, output.weight and "
             "token_embd.weight too, the override flags still applying (llama-quantize's --pure)")
    if not importance:
        return
    add("--imatrix", metavar="FILE",
        help="--out-type gguf: llama.cpp's importance matrix (llama-imatrix's GGUF or .dat) weighting the "
             "quantizer's choices, as llama-quantize --imatrix")
    add("--imatrix-texts", metavar="FILE",
        help="--out-type gguf with a K-quant (or q4_0 ... q5_1) --gguf-type: compute the importance matrix on the "
             "merge itself from FILE's texts (one a line) before encoding, in a forward pass over the merge never "
             "written, one decoder layer at a time, journaled (not with --imatrix)")
    add("--gguf-target-size", metavar="SIZE",
        help="--out-type gguf with --imatrix-texts: choose each decoder layer matrix's type (Q2_K ... Q8_0) for "
             "the least loss the same pass measures on the texts, the file at most SIZE (e.g. 90MB); the rest as "
             "--gguf-type writes it")
    add("--gguf-target-bpw", metavar="X", type=float,
        help="as --gguf-target-size, at most X bits per weight over every tensor")


def _plan_parser(sub: SubParsers) -> None:
    plan = sub.add_parser("plan", help="validate CONFIG and estimate disk, download, RAM and time, writing nothing",
                          description="Validate a config against the models' headers, estimate what the merge "
                                      "needs here (disk for OUT, state and downloads, peak RAM, time from a short "
                                      "disk probe) and say whether it fits. Exit 0 when it fits, 2 when it will not "
                                      "(with the reasons and what to change).")
    plan.add_argument("config", metavar="CONFIG")
    plan.add_argument("out", metavar="OUT", nargs="?",
                      help="output directory to check the disk of, or hf://NAMESPACE/NAME [optional]")
    _merge_flags(plan)
    flags.add(plan, flags.MAX_DISK, flags.STATE_DIR, flags.MAX_MEMORY, flags.TRANSFORMERS_CACHE, flags.DEVICE,
              flags.CUDA, flags.NUM_THREADS)
    flags.add_staging(plan)
    plan.add_argument("--bandwidth", metavar="DOWN[/UP]",
                      help="the link's rates per second for the network estimate, e.g. 150MB/75MB [default: the "
                           "download rate measured on a hub input; the upload rate unknown]")
    plan.add_argument("--session", metavar="LENGTH",
                      help="a notebook session's length (12h, 90m): how many sessions the merge takes at the "
                           "measured or --bandwidth rate")
    plan.add_argument("--probe-size", default="32MiB", metavar="SIZE",
                      help="bytes of the disk speed probe written (then deleted) beside OUT; 0 skips it")
    plan.add_argument("--json", action="store_true",
                      help="print JSON (schema in resumerge/analyses/estimate/costs.py; a recipe's in "
                           "resumerge/runs/recipes/estimate.py)")
    flags.add_executor(plan)


def _demo_parser(sub: SubParsers) -> None:
    demo = sub.add_parser("demo", help="generate small models, merge, interrupt, resume, show status",
                          description="A self-contained tour: generates tiny models, starts a merge that is "
                                      "killed part-way, resumes it, and checks the output is byte-identical.")
    demo.add_argument("dir", metavar="DIR", nargs="?", default=None,
                      help="working directory (default: demo/ under the state dir, never the current directory)")


def _extract_parser(sub: SubParsers) -> None:
    """``extract-lora``: mergekit-extract-lora's options, plus --exact, --plan and the shared ones."""
    from resumerge.cli.ignoredflags import (
        EXTRACT_UNNEEDED,
        EXTRACT_UNNEEDED_WITH_VALUE,
        UNNEEDED_FLAGS,
        UNNEEDED_WITH_VALUE,
        accept_ignored,
    )

    ex = sub.add_parser("extract-lora", help="extract a PEFT LoRA adapter from a fine-tune and its base",
                        description="Extract a LoRA adapter (mergekit-extract-lora's options and meanings): each "
                                    "module's task vector FT - BASE truncated to --max-rank. Journaled: an "
                                    "interrupted extraction finishes with resumerge resume OUT.")
    ex.add_argument("--model", required=True, metavar="FT", help="fine-tuned model (folder or hub id)")
    ex.add_argument("--base-model", required=True, metavar="BASE", help="base model (folder or hub id)")
    ex.add_argument("--out-path", required=True, dest="out", metavar="OUT",
                    help="output folder, or hf://NAMESPACE/NAME")
    ex.add_argument("--max-rank", type=int, default=128, metavar="R", help="maximum rank [default: 128]")
    ex.add_argument("--sv-epsilon", type=float, default=0.0, metavar="EPS",
                    help="drop singular values at or below EPS (a module's rank may then be lower) [default: 0]")
    ex.add_argument("--distribute-scale", action=argparse.BooleanOptionalAction, default=True,
                    help="split the singular values between A and B (√s each) [default: on]")
    ex.add_argument("--embed-lora", action=argparse.BooleanOptionalAction, default=False,
                    help="LoRA for embeddings and head instead of saving them whole [default: off]")
    ex.add_argument("--save-module", action="append", default=[], dest="save_modules", metavar="NAME",
                    help="save this module (full name or last part) whole, in modules_to_save")
    ex.add_argument("-e", "--exclude-regex", action="append", default=[], dest="exclude_regexes", metavar="RE",
                    help="do not extract modules matching RE")
    ex.add_argument("-i", "--include-regex", action="append", default=[], dest="include_regexes", metavar="RE",
                    help="extract only modules matching RE")
    ex.add_argument("--skip-undecomposable", action="store_true",
                    help="leave out modules that are not matrices (norms) instead of saving them whole")
    ex.add_argument("--exact", action="store_true",
                    help="the exact rank-R truncation of every task vector (mergekit's full SVD's numbers, up to each "
                         "component's sign) instead of the faster randomized one (within 0.5%% of its error)")
    ex.add_argument("--allow-crimes", action="store_true",
                    help="accepted for mergekit command lines: modules are matched by name and shape only")
    ex.add_argument("--unsafe-truncate-embeddings", action="store_true",
                    help="with --embed-lora, cut embeddings and head of different vocabularies to the common rows")
    ex.add_argument("--random-seed", type=int, default=0, metavar="N",
                    help="seed of the randomized truncation (drawn per module) [default: 0]")
    flags.add(ex, flags.RESTART)
    ex.add_argument("--no-write-model-card", action="store_false", dest="write_model_card",
                    help="write no README.md")
    flags.add(ex, flags.DEVICE, flags.CUDA, flags.TRANSFORMERS_CACHE)
    flags.add(ex, flags.PUBLIC)
    _estimate_flags(ex)
    _common(ex)
    accept_ignored(ex, {**UNNEEDED_FLAGS, **EXTRACT_UNNEEDED}, {**UNNEEDED_WITH_VALUE, **EXTRACT_UNNEEDED_WITH_VALUE})


def _surgery_parser(sub: SubParsers) -> None:
    """``tokensurgeon``: mergekit-tokensurgeon 0.1.5's arguments and options, plus --plan and the shared ones."""
    from resumerge.cli.ignoredflags import UNNEEDED_FLAGS, UNNEEDED_WITH_VALUE, accept_ignored
    from resumerge.runs.transplant.spec import MATCH_CHOICES, METHODS, SUBWORD_METHODS, WEIGHT_SCHEMES

    ts = sub.add_parser("tokensurgeon", help="give a model another model's tokenizer (mergekit-tokensurgeon)",
                        description="MODEL's weights with DONOR's vocabulary and tokenizer files: the token "
                                    "embedding and head rows of tokens both hold copied, the others approximated "
                                    "from MODEL's own rows (mergekit-tokensurgeon 0.1.5's options and meanings). "
                                    "Journaled per batch of tokens: an interrupted run finishes with resumerge "
                                    "resume OUT.")
    ts.add_argument("model", metavar="MODEL", help="the model whose weights are kept (folder or hub id)")
    ts.add_argument("donor", metavar="DONOR", help="the model whose tokenizer it gets (folder or hub id)")
    ts.add_argument("out", metavar="OUT", help="output folder, or hf://NAMESPACE/NAME")
    ts.add_argument("-a", "--approximation-method", choices=METHODS, default="omp",
                    help="how the rows of DONOR's tokens MODEL lacks are made [default: omp]")
    ts.add_argument("-k", "--k", type=int, default=64, metavar="K",
                    help="atoms (omp, stb, mp_rope) or nearest neighbours (common_interpolation) [default: 64]")
    ts.add_argument("-c", "--cosine-similarity", action=argparse.BooleanOptionalAction, default=False,
                    help="cosine distance for common_interpolation's neighbours [default: off]")
    ts.add_argument("-w", "--weight-scheme", choices=WEIGHT_SCHEMES, default="distance_proportional",
                    help="common_interpolation's weights [default: distance_proportional]")
    ts.add_argument("-s", "--subword-method", choices=SUBWORD_METHODS, default="mean",
                    help="how subword's pieces combine [default: mean]")
    ts.add_argument("--batch-size", type=int, default=512, metavar="N",
                    help="tokens approximated (and kept durably) per batch; 0 or less: one batch [default: 512]")
    ts.add_argument("-pm", "--prefix-match", choices=MATCH_CHOICES, default="no",
                    help="copy the row of MODEL's longest prefix of a token, for both matrices or the one named "
                         "[default: no]")
    ts.add_argument("-bm", "--byte-match", choices=MATCH_CHOICES, default="no",
                    help="copy MODEL's <0xNN> row for a one-byte token (and back) [default: no]")
    ts.add_argument("--magikarp", action=argparse.BooleanOptionalAction, default=False,
                    help="lend only the rows of tokens both models trained well (arXiv:2405.05417); zero DONOR's "
                         "tokens neither trained well [default: off]")
    ts.add_argument("-nvn", "--new-vocab-noise", type=float, default=None, metavar="SIGMA",
                    help="add N(0, SIGMA^2) noise to the approximated rows")
    ts.add_argument("-nvs", "--new-vocab-scale", type=float, default=None, metavar="S",
                    help="multiply the approximated rows by S (after the noise)")
    ts.add_argument("--allow-crimes", action="store_true",
                    help="take DONOR's own token embedding when DONOR lacks MODEL's tensor names")
    ts.add_argument("--random-seed", type=int, default=0, metavar="N",
                    help="seed of randn, john_hewitt and the noise (drawn per batch) [default: 0]")
    ts.add_argument("--out-shard-size", metavar="SIZE",
                    help="maximum bytes per output shard, e.g. 5B or 500M [default: 5B for a folder]")
    flags.add(ts, flags.RESTART)
    _out_type_flags(ts, importance=False)
    ts.add_argument("--no-write-model-card", action="store_false", dest="write_model_card",
                    help="write no README.md and no tokensurgeon.json")
    flags.add(ts, flags.DEVICE, flags.CUDA, flags.TRANSFORMERS_CACHE)
    ts.add_argument("--stream-inputs", action="store_true", help="read every hub input by HTTP Range")
    flags.add(ts, flags.PUBLIC)
    _estimate_flags(ts)
    _common(ts)
    accept_ignored(ts, UNNEEDED_FLAGS, UNNEEDED_WITH_VALUE)


def _estimate_flags(p: argparse.ArgumentParser) -> None:
    """``--plan`` and its ``--json`` of the commands that write a model (extract-lora, tokensurgeon)."""
    p.add_argument("--plan", action="store_true",
                   help="validate and estimate disk, RAM and time as resumerge plan does, writing nothing (exit 0 "
                        "when it fits, 2 when not)")
    p.add_argument("--json", action="store_true", help="with --plan: print JSON")


def _common(p: argparse.ArgumentParser) -> None:
    flags.add(p, flags.STATE_DIR)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    flags.add(p, flags.MAX_MEMORY)
    flags.add_staging(p)
    flags.add(p, flags.MAX_GPU_MEMORY, flags.MAX_DISK)
    p.add_argument("--commit-every", type=int, default=None, metavar="N",
                   help="hf:// OUT: commit after N uploaded files [default: each file once uploaded, the first 20 "
                        "in an hour at once, then at most one commit a minute holding every file uploaded by then]")
    p.add_argument("--commit-interval", type=float, default=None, metavar="SECONDS",
                   help="hf:// OUT: commit files waiting this long even when fewer than N [default: 60 with "
                        "--commit-every]; commits stay under 100 an hour (the hub allows 128 per repo)")
    flags.add(p, flags.NUM_THREADS)


def _keep_flag(p: argparse.ArgumentParser) -> None:
    from resumerge.config.settings import KEEP_WORKERS

    p.add_argument("--keep-workers", metavar="DURATION",
                   help="with --executor ray on a cluster that outlives the run (--ray-address, $RAY_ADDRESS): keep "
                        "each node's worker this long idle for the next run or resume, which then computes as soon "
                        "as it has planned (or a check, measure, eval or evolve on Ray, whose actors it hosts); an "
                        "idle worker holds no CPU; 0 ends them with the run "
                        f"[default: {KEEP_WORKERS / 60:g}m]")


@dataclass(frozen=True)
class Command:
    """One command, the one row the parser (:func:`build_parser`), the dispatch
    (:func:`resumerge.cli.commands.main`) and the command reference (:mod:`resumerge.cli.reference`) read: its
    ``name``; its ``parser``, the function that adds it or the module that declares it (:func:`_add_declared`); what
    ``runs`` it, ``"module:function"``, imported when it runs (so no other command pays for its imports) and handed
    the parsed arguments. A new command is its module and one row."""

    name: str
    parser: Callable[[SubParsers], None] | str
    runs: str

    def run(self, args: argparse.Namespace) -> int:
        """Run the command on the parsed ``args``; its exit code."""
        found: Callable[[Any], int] = named(self.runs)
        return found(args)


_HERE = "resumerge.cli.commands"
# The commands that are no analysis, in the order `resumerge --help` lists them: the analyses' (:func:`commands`) come
# between these and the last.
_OWN = (
    Command("run", _run_parser, f"{_HERE}:_run"),
    Command("resume", _resume_parser, f"{_HERE}:_resume"),
    Command("status", _status_parser, f"{_HERE}:_status"),
    Command("verify", _verify_parser, f"{_HERE}:_verify"),
    Command("plan", _plan_parser, f"{_HERE}:_plan"),
    Command("extract-lora", _extract_parser, f"{_HERE}:_extract_lora"),
    Command("tokensurgeon", _surgery_parser, f"{_HERE}:_tokensurgeon"),
)
_LAST = Command("demo", _demo_parser, "resumerge.cli.demo:run_demo")


def commands() -> Mapping[str, Command]:
    """Every command by name, in the order `resumerge --help` lists them: :data:`_OWN`, each analysis's (a row of
    :data:`resumerge.config.analyses.ANALYSES`, whose command module declares its parser), then :data:`_LAST`."""
    declared = (Command(row.name, row.runs.partition(":")[0], row.runs) for row in analyses.ANALYSES)
    return {command.name: command for command in (*_OWN, *declared, _LAST)}


def asked_command(argv: Sequence[str] | None) -> str | None:
    """The command a command line starts with, if it starts with one (anything else, ``--help`` or ``--version``
    first, a misspelt command, needs the parser of every command)."""
    words = sys.argv[1:] if argv is None else list(argv)
    return words[0] if words and words[0] in commands() else None


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (the top-level one when no command was given)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            chosen: argparse.ArgumentParser = action.choices[command]
            return chosen
    return parser
