"""The flags several commands share, each declared once here with its one help text and added by every command
that takes it (:func:`add`), and the one way a command's parsed flags become its API call's keyword arguments
(:func:`api_options`): the settings they give travel as the API's option groups (``--max-memory``, ``--device`` and
``--max-gpu-memory`` as one :class:`~resumerge.api.options.Resources`), ``--executor`` and its settings as one
executor object.

``--executor``'s choices are the one table of executors (:data:`resumerge.config.passplace.EXECUTORS`), so a new
executor is a choice of every command at once."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# What a Ray node needs, said by --executor's help (the extra's install line, as the refusal without Ray says it).
RAY_NEEDS = "Ray on every node: pip install -c constraints.txt -e '.[ray]' in the clone"
# Options that shape what the terminal shows, not what the API does (the rest of each command's options are
# keyword arguments of its API function): the command itself, progress and JSON output, and mergekit's -v.
CLI_ONLY = frozenset({"command", "quiet", "json", "v_flag"})
# Options that are settings of the executor object the API takes (``executor=RayExecutor(address, keep_workers)``):
# the command folds them into it (:func:`resumerge.api.flagmap.executor_option`).
FOLDED = MappingProxyType({"ray_address": "executor", "keep_workers": "executor"})


@dataclass(frozen=True)
class Flag:
    """One flag as ``argparse`` takes it: its ``names`` and the rest of ``add_argument``'s keywords."""

    names: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)

    def add_to(self, adds: Callable[..., Any]) -> None:
        adds(*self.names, **self.options)


def _executor_choices() -> dict[str, Any]:
    from resumerge.config import passplace  # its table read when a parser is built

    return {"choices": tuple(passplace.EXECUTORS)}


STATE_DIR = Flag(("--state-dir",), {
    "metavar": "DIR",
    "help": "the state directory, on local disk: runs' ledgers, passes' journals and what they keep [default: "
            "$RESUMERGE_STATE_DIR, else $XDG_STATE_HOME/resumerge or ~/.local/state/resumerge; runs recorded in "
            "./state are still found there]"})
MAX_MEMORY = Flag(("--max-memory",), {
    "metavar": "SIZE",
    "help": "RAM budget for the whole process (its resident memory, interpreter and torch included), e.g. 6GB "
            "[default: 80 %% of what the machine or container allows]; work in flight waits or shrinks before the "
            "budget is reached; plan (and --plan) names the smallest that works"})
DEVICE = Flag(("--device",), {
    "default": "cpu", "metavar": "DEVICE",
    "help": "where the arithmetic runs: cpu or cuda[:N]: a merge's methods (reading and writing stay on the host; a "
            "resume keeps the device; plan times it there), or a pass's layers, each moved to the GPU while it runs "
            "with the hidden states kept there (a model larger than the GPU's memory runs on it; not with "
            "--executor ray) [default: cpu]"})
CUDA = Flag(("--cuda",), {"action": "store_const", "const": "cuda", "dest": "device",
                          "help": "same as --device cuda (mergekit's flag)"})
MAX_GPU_MEMORY = Flag(("--max-gpu-memory",), {
    "metavar": "SIZE", "help": "GPU memory budget with --device cuda [default: 85 %% of the GPU's free memory]"})
MAX_DISK = Flag(("--max-disk",), {
    "metavar": "SIZE",
    "help": "bytes resumerge may keep on the local disk: with hf:// OUT, staged files not yet committed to the "
            "repo stay under it (work waits for commits); evolve's structure search keeps its cache of the base's "
            "hidden states under it (every few layers where every layer's do not fit) [default: no bound]"})
RESTART = Flag(("--restart",), {
    "action": "store_true", "help": "discard a different earlier run in OUT (only files it wrote) and start over"})
PUBLIC = Flag(("--public",), {"action": "store_true",
                              "help": "hf:// OUT: create a missing repo public [default: private]"})
TRANSFORMERS_CACHE = Flag(("--transformers-cache",), {
    "metavar": "DIR", "dest": "cache_dir",
    "help": "Hugging Face cache directory for hub models [default: HF_HUB_CACHE / HF_HOME]"})
TRUNCATE_TEXTS = Flag(("--truncate-texts",), {
    "action": "store_true",
    "help": "cut each text longer than the models' context (max_position_embeddings) to its first tokens, rather "
            "than refuse it (exit 2, naming its line)"})
NUM_THREADS = Flag(("-j", "--num-threads"), {
    "dest": "num_threads", "type": int, "default": None, "metavar": "N",
    "help": "threads torch uses for arithmetic (plan times it with as many) [default: torch's choice]"})
STAGING_DIR = Flag(("--staging-dir",), {
    "metavar": "DIR", "dest": "staging",
    "help": "write each file on this local dir first, then publish it to OUT by copy + verify [default: only when "
            "OUT is on Drive/FUSE/network storage, in the state dir]"})
NO_STAGING = Flag(("--no-staging",), {"action": "store_const", "const": False, "dest": "staging",
                                      "help": "always write straight into OUT"})
RAY_ADDRESS = Flag(("--ray-address",), {
    "metavar": "ADDRESS",
    "help": "with --executor ray: the cluster to join [default: $RAY_ADDRESS, else a Ray started on this machine "
            "for the command]"})
EXECUTOR_HELP = (f"where the work runs: local, this process; ray, the nodes of a Ray cluster ({RAY_NEEDS}; the "
                 "models, texts and outputs on paths every node sees, or hf://): a merge's shards computed by a "
                 "worker per node, a pass's models or layers on actors of their own, a search's candidates spread "
                 "over the nodes; the bytes are the same, and what was started with one resumes with the other "
                 "[default: local]")

# The groups a forward pass's command takes (check, measure, eval), in the order their --help lists them.
PASS_FLAGS = (MAX_MEMORY, STATE_DIR, DEVICE, MAX_GPU_MEMORY)
# What a forward pass opens as a model (resumerge.forward.opening.opened.open_for_pass), as the pass commands' help says
# it.
PASS_MODEL = ("a folder, a GGUF file, or a hub repo as hf://NAMESPACE/NAME[@REVISION] (a GGUF file in one as "
              "hf://NAMESPACE/NAME/PATH.gguf[@REVISION]), read by byte range")


def add(p: argparse.ArgumentParser, *flags: Flag) -> None:
    """Add ``flags`` to the parser ``p``, in that order."""
    for each in flags:
        each.add_to(p.add_argument)


def add_staging(p: argparse.ArgumentParser) -> None:
    """``--staging-dir DIR`` and ``--no-staging``, one or the other."""
    staging = p.add_mutually_exclusive_group()
    for each in (STAGING_DIR, NO_STAGING):
        each.add_to(staging.add_argument)


def add_executor(p: argparse.ArgumentParser) -> None:
    """``--executor`` (its choices the API's executor names, ``local`` the default) and ``--ray-address``."""
    p.add_argument("--executor", default="local", help=EXECUTOR_HELP, **_executor_choices())
    RAY_ADDRESS.add_to(p.add_argument)


def api_options(args: argparse.Namespace, function: Callable[..., Any],
                leave: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The keyword arguments of ``function`` from the parsed options: every dest but presentation (:data:`CLI_ONLY`),
    the mergekit flags accepted only to be ignored and ``leave``, the executor's own flags folded into the executor
    object (:data:`FOLDED`), each other packed into the option group that has a field of its name
    (:func:`resumerge.api.flagmap.grouped`; tests/test_front_door.py holds the flags and the API's options equal)."""
    from resumerge.api.flagmap import executor_option, grouped

    options = {k: v for k, v in vars(args).items() if k not in CLI_ONLY | leave and not k.startswith("unneeded_")}
    if "executor" in options:
        folded = {k: options.pop(k) for k in FOLDED if k in options}
        options["executor"] = executor_option(options["executor"], **folded)
    return grouped(function, options)
