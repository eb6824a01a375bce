"""Named points of the commit protocol where a test can make the process die at once (SIGKILL itself).

``RESUMERGE_KILL_AT=point`` kills at the first time ``point`` is reached; ``point:N`` at the N-th time.
``RESUMERGE_PAUSE_AT=point:SECONDS`` sleeps that long each time ``point`` is reached, before the kill is looked at:
a test that kills one process from another (the MoE prompt pass kills its run) gives the other time to get where
the test needs it, instead of racing it. ``RESUMERGE_STOP_AT=point`` (or ``point:N``) stops the process there
(SIGSTOP itself): a test that needs it held at that point (a lock taken, a journal written) waits until it is
stopped, does what it came for and continues it (SIGCONT), with no sleep to outlast. The test suite walks every
point (the local ones, the staged one, the hub ones and MoE's, each with the run it needs) and checks that
``resume`` still ends with identical output. Unset, this is three environment lookups per call.
"""

from __future__ import annotations

import os
import signal
import time

# Reached by every merge, whatever OUT is (the crash test kills a local merge at each).
LOCAL_POINTS = (
    "after_temp_write",
    "after_fsync",
    "after_rename",
    "after_dir_fsync",
    "after_ledger_commit",
    "after_manifest_write",
    "mid_shard_write",
    "during_index_write",
    "during_config_write",
    "during_tokenizer_write",
    "before_input_hashing",
)
# Reached only by a file written in place, unit by unit (a GGUF output in a local OUT: resumerge.merge.store.units),
# around each unit: written, fsynced, journaled (tests/test_gguf_units.py kills at each occurrence of each).
UNIT_POINTS = ("after_unit_write", "after_unit_fsync", "after_unit_commit")
# Reached only when OUT is staged on local disk and copied (Drive and other mounts).
STAGED_POINTS = ("after_publish_copy",)
# Reached only when OUT is a hub repo (the hub kill trials walk each).
HUB_POINTS = ("hub_after_upload", "hub_before_commit", "hub_after_commit")
# Reached only by the prompt forward pass of a mergekit-moe config's hidden-state gates, after each decoder
# layer's hidden states are saved (tests/moe/test_resume.py kills there). The pass runs in a process of its own,
# which kills the run's process there and then dies with it, as when the run is killed from outside.
MOE_POINTS = ("after_router_layer",)
# Reached by ``resumerge check``'s forward pass after each decoder layer's hidden states are saved
# (tests/check/test_realmodel.py kills there).
CHECK_POINTS = ("after_check_layer",)
# Reached by ``resumerge measure`` after each decoder layer's Grams and hidden states are durable (its own pass and
# RegMean++'s merged one; tests/test_regmean_merge.py and tests/test_regmean_plus.py kill there).
MEASURE_POINTS = ("after_measure_layer",)
# Reached by ``resumerge eval``'s pass after each decoder layer's hidden states are saved
# (tests/evaluation/test_resume.py kills there).
EVAL_POINTS = ("after_eval_layer",)
# Reached by eval's layer-streamed generation after each decoder layer of a token step (not durable: a kill there
# reruns the step) and after each token step's file is durable (tests/evaluation/test_streamgen.py kills there).
GENERATION_POINTS = ("after_generation_layer", "after_generation_step")
# Reached by ``resumerge evolve``: after a candidate's figures are journaled (inside a generation), after a
# generation's state is durable (between generations), and while ``best.yml``'s temp file is written
# (tests/evolve/test_kills.py kills at each).
EVOLVE_POINTS = ("after_evolve_candidate", "after_evolve_generation", "during_best_write")
# Reached by ``resumerge tokensurgeon`` after each approximated batch of tokens is durable in the run's folder, and
# once its vocabularies are matched, while it plans (tests/transplant/test_resume.py kills at both).
SURGERY_POINTS = ("after_surgery_batch", "after_surgery_match")
# Reached by ``run --imatrix-texts``'s importance matrix pass over the merge after each decoder layer's sums and hidden
# states are durable (tests/test_imatrix_merge.py kills there).
IMATRIX_POINTS = ("after_imatrix_layer",)
# Every point the package reaches; a test derived from the code holds this equal to the points used.
POINTS = (LOCAL_POINTS + UNIT_POINTS + STAGED_POINTS + HUB_POINTS + MOE_POINTS + CHECK_POINTS + MEASURE_POINTS
          + EVAL_POINTS + GENERATION_POINTS + EVOLVE_POINTS + SURGERY_POINTS + IMATRIX_POINTS)

_counts: dict[str, int] = {}


def _target(variable: str = "RESUMERGE_KILL_AT") -> tuple[str, int] | None:
    spec = os.environ.get(variable)
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    return name, int(nth) if nth else 1


# How long a helper process that killed its run waits to die with it before it goes on (a test then sees it).
_FOLLOW_SECONDS = 30.0


def _pause(point: str) -> None:
    spec = os.environ.get("RESUMERGE_PAUSE_AT")
    if spec:
        name, _, seconds = spec.partition(":")
        if name == point:
            time.sleep(float(seconds))


_stops: dict[str, int] = {}


def _stop(point: str) -> None:
    target = _target("RESUMERGE_STOP_AT")
    if target is None or target[0] != point:
        return
    _stops[point] = _stops.get(point, 0) + 1
    if _stops[point] == target[1]:
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once a SIGCONT continues it


def reach(point: str, *, run_pid: int | None = None) -> None:
    """Die with SIGKILL if ``RESUMERGE_KILL_AT`` names ``point`` and this is its chosen occurrence (after the pause
    ``RESUMERGE_PAUSE_AT`` asks for there, and the stop ``RESUMERGE_STOP_AT`` asks for, if any).

    A helper process passes ``run_pid``, its run's process: that one is killed, and the helper waits to die with
    it (its parent watch) instead of going on."""
    _pause(point)
    _stop(point)
    target = _target()
    if target is None or target[0] != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == target[1]:
        os.kill(run_pid if run_pid is not None else os.getpid(), signal.SIGKILL)
        if run_pid is not None:
            time.sleep(_FOLLOW_SECONDS)
