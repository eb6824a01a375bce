"""Where a ``check``'s time goes, next to transformers' whole-model pass over the same texts.

Usage::

    python bench/check_costs.py [--layers N] [--work DIR] [--runs N] [--checkout TREE ...] [--no-peer]

Makes the models as ``bench/bench_check.py`` does (SmolLM2-135M-Instruct in float32 as the base, two parents
nudged under a seed, their mean as the merge; ``--layers 64``: SmolLM2's layers repeated to 64, a 1.02 GB model),
then, alternating, ``--runs`` times: for each ``--checkout`` (a resumerge tree: this one, and an older one unpacked
with ``git archive COMMIT | tar -x -C DIR``), a fresh process that imports the check, runs it in a fresh state dir
and times each of its parts (wall and CPU seconds of the process): the imports, opening the models (headers), the
texts and tokenizer, the proof of the inputs (where the tree has one), the static pass, the forward pass (its
layers), the heads, and the rest (the report, its chart, the model card); then the check asked again (the same
state dir); then the peer, timed the same way: its imports, each model's ``from_pretrained``, its forward and
log-softmax. Prints one table a run, the machine's load beside it.

Each check's state dir is ``check-state`` in the work folder, removed before and after each check: a bench ended by
SIGTERM or SIGHUP (``timeout``, a closed terminal) ends as on Ctrl-C, its running child killed and the state dir
removed (their default action left the child running and a ``/tmp/check-costs-*`` dir behind); one killed outright
leaves it to the next run, which removes it first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# Run in a fresh process under the tree timed: wraps the check's parts in timers, then runs it.
CHILD = r"""
import json, os, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
spent = {}
def timed(owner, name, label):
    real = getattr(owner, name, None)
    if real is None:
        return
    def wrapper(*a, **k):
        w, c = clock()
        try:
            return real(*a, **k)
        finally:
            w2, c2 = clock()
            got = spent.setdefault(label, [0.0, 0.0])
            got[0] += w2 - w; got[1] += c2 - c
    setattr(owner, name, wrapper)
w0, c0 = clock()
from resumerge import api
from resumerge.analyses.check import run
from resumerge.forward.compared import passes
w1, c1 = clock()
spent["imports"] = [w1 - w0, c1 - c0]
timed(run, "find_models", "open models")
timed(run, "cached_sequences", "texts, tokenizer")
try:
    from resumerge.forward.job import proof
    timed(proof.PassProof, "record", "proof")
    timed(proof.PassProof, "prove", "proof")
except ImportError:
    pass
timed(run, "_static_before", "static")
timed(run, "_static", "static")
timed(run, "forward_pass", "forward + heads")
timed(passes, "head_figures", "heads")
merge, base, parents, texts, state = json.loads(sys.argv[1])
report = api.check(merge, base=base, parents=parents, prompts=texts, state_dir=state)
w2, c2 = clock()
spent["check"] = [w2 - w1, c2 - c1]
again = api.check(merge, base=base, parents=parents, prompts=texts, state_dir=state)
w3, c3 = clock()
spent["asked again"] = [w3 - w2, c3 - c2]
print(json.dumps({"spent": spent, "nll": [m.nll for m in report.models], "total": [w3 - w0 - spent["asked again"][0],
                  c3 - c0 - spent["asked again"][1]]}))
"""

PEER = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
spent = {}
def add(label, since):
    w, c = clock(); got = spent.setdefault(label, [0.0, 0.0]); got[0] += w - since[0]; got[1] += c - since[1]
    return w, c
t = clock()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t = add("imports", t)
paths, texts = json.loads(sys.argv[1]), open(sys.argv[2]).read().splitlines()
tok = AutoTokenizer.from_pretrained(paths[0])
seqs = [torch.tensor([tok(x)["input_ids"]]) for x in texts if x.strip()]
t = add("texts, tokenizer", t)
lps = []
with torch.no_grad():
    for p in paths:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        t = add("from_pretrained", t)
        lps.append([torch.log_softmax(model(input_ids=s).logits[0, :-1], -1) for s in seqs])
        del model
        t = add("forward + log-softmax", t)
n = sum(s.shape[1] - 1 for s in seqs)
nll = [sum(float(-lp.gather(-1, s[0, 1:, None]).sum()) for lp, s in zip(m, seqs)) / n for m in lps]
kl = [sum(float((o.exp() * (o - mm)).sum()) for o, mm in zip(m, lps[0])) / n for m in lps[1:]]
t = add("figures", t)
print(json.dumps({"spent": spent, "nll": nll}))
"""


def _child(code: str, args: list[str], checkout: Path | None) -> tuple[float, float, dict]:
    """Wall and CPU seconds (the child's own, from its rusage) of ``code`` run with ``args``, and what it printed."""
    import resource

    env = {**os.environ}
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-P", "-c", code, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"failed: {done.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, json.loads(done.stdout.strip().splitlines()[-1])


def _load() -> str:
    return os.getloadavg().__repr__()


def _table(name: str, wall: float, cpu: float, spent: dict[str, list[float]]) -> None:
    print(f"  {name}: process {wall:.2f} s wall, {cpu:.2f} s CPU (load {os.getloadavg()[0]:.1f})")
    for label, (w, c) in spent.items():
        print(f"    {label:24s} {w:7.2f} s wall {c:7.2f} s CPU")


def _signals_end_the_bench() -> None:
    """SIGTERM and SIGHUP end the bench by an exception, as Ctrl-C does: ``subprocess.run`` kills the running child
    and each ``finally`` runs (the state dir removed)."""
    def end(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, end)


def main() -> None:
    from bench_check import _make, tiled

    _signals_end_the_bench()

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "resumerge-bench-check")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--checkout", type=Path, action="append", default=[])
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    work = args.work if args.layers is None else args.work / f"set{args.layers}"
    base, parents, merge = _make(work, 2, None if args.layers is None else tiled(args.work, args.layers))
    texts = work / "texts.txt"
    from bench_check import TEXTS

    texts.write_text("\n".join(TEXTS) + "\n")
    trees = args.checkout or [ROOT]
    for run in range(args.runs):
        order = trees if run % 2 == 0 else trees[::-1]
        for tree in order:
            state = work / "check-state"  # each check's (its journal, report, records): fresh, none left behind
            shutil.rmtree(state, ignore_errors=True)
            doc = json.dumps([str(merge), str(base), [str(p) for p in parents], str(texts), str(state)])
            try:
                wall, cpu, found = _child(CHILD, [doc], tree)
            finally:
                shutil.rmtree(state, ignore_errors=True)
            _table(f"run {run} check, {tree}", wall, cpu, found["spent"])
            print(f"    NLL {[round(x, 5) for x in found['nll']]}")
        if not args.no_peer:
            wall, cpu, found = _child(PEER, [json.dumps([str(merge), str(base), *map(str, parents)]), str(texts)],
                                      None)
            _table(f"run {run} transformers", wall, cpu, found["spent"])
            print(f"    NLL {[round(x, 5) for x in found['nll']]}")


if __name__ == "__main__":
    main()
