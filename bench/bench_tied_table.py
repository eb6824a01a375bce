"""What a generation's tied table costs at its two steps: the input embeddings' rows (the texts' tokens) merged at the
embedding step, the whole table merged again at the head step, against the table merged once and shared by both.

Usage::

    PYTHONPATH=TREE python bench/bench_tied_table.py [--hidden 1024 --vocab 32000] [--popsize 8] [--rows 107]
        [--runs 3] [--work DIR]

Makes three generated Llama-style float32 models with a tied head (base, a, b; two layers: only the table is read)
and ``--popsize`` TIES candidates (bfloat16, as evolve's genome merges), opened as one generation
(:func:`resumerge.api.open_population`), then alternates, each block in one ``Population.layer()`` as the pass runs
it, its CPU seconds (this process, one thread: the pass's kernels run serial where its workers fill the threads):
``rows``, every candidate's ``--rows`` rows of ``model.embed_tokens.weight`` (what the embedding step merges now),
and ``whole``, every candidate's whole table (what the head step merges, and what the embedding step would merge if
the table were merged once and kept for the head). Merging once and sharing saves ``rows`` per generation and holds
every candidate's table (``held``, in the reader's float32, and in the stored bfloat16) from the embedding step to the
heads. Checks that the rows are those rows of the whole table, to the bit.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--popsize", type=int, default=8)
    parser.add_argument("--rows", type=int, default=107)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "resumerge-bench-tied")
    args = parser.parse_args()
    import torch
    import yaml

    from resumerge import api
    from resumerge.cli.modelgen import ModelSpec, make_model
    from resumerge.forward.engine.reader import CastReader, Weights, base_formats

    torch.set_num_threads(1)
    spec = ModelSpec(layers=2, hidden=args.hidden, intermediate=2 * args.hidden, vocab=args.vocab,
                     heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 256), tied=True,
                     shard_bytes=1 << 30)
    models = []
    for seed, name in enumerate(("base", "a", "b"), start=1):
        path = args.work / f"{name}-{args.hidden}x{args.vocab}"
        if not (path / "config.json").is_file():
            make_model(path, spec, seed=seed)
        models.append(path)
    configs = []
    for c in range(args.popsize):
        config = args.work / f"candidate-{c}.yml"
        config.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": str(models[0]), "dtype": "bfloat16",
                                          "models": [{"model": str(models[1]), "parameters": {
                                              "weight": 0.3 + 0.05 * c, "density": 0.5 + 0.03 * c}},
                                                     {"model": str(models[2]), "parameters": {
                                              "weight": 0.7 - 0.05 * c, "density": 0.8 - 0.03 * c}}]}))
        configs.append(config)
    rows = torch.unique(torch.randint(0, args.vocab, (args.rows * 2,), generator=torch.Generator().manual_seed(0)))
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(1))[:args.rows]].sort().values
    name = "model.embed_tokens.weight"
    with api.open_population(configs, state_dir=args.work / "state") as population:
        readers = []
        for m in population.candidates:
            weights = Weights.of(m.opened.directory, m.opened.tensors, source=m.source)
            readers.append(CastReader(weights, base_formats(weights.tensors, m.opened.config, weights.directory),
                                      torch.float32, key=str(m.plan.options)))

        def block(whole: bool) -> tuple[float, list[torch.Tensor]]:
            start = time.process_time()
            with population.layer():
                found = [r.read(name) if whole else r.read_rows(name, rows) for r in readers]
            return time.process_time() - start, found

        print(f"table {args.vocab}x{args.hidden}, {args.popsize} candidates, {len(rows)} rows, "
              f"load {os.getloadavg()[0]:.1f}")
        for run in range(args.runs):
            order = (False, True) if run % 2 == 0 else (True, False)
            spent: dict[bool, float] = {}
            kept: dict[bool, list[torch.Tensor]] = {}
            for whole in order:
                spent[whole], kept[whole] = block(whole)
            assert all(torch.equal(w[rows], r) for w, r in zip(kept[True], kept[False])), "rows differ"
            print(f"  run {run}: rows {spent[False]:.2f} CPU s, whole {spent[True]:.2f} CPU s "
                  f"(load {os.getloadavg()[0]:.1f})")
        table = args.vocab * args.hidden
        print(f"  held if shared: {args.popsize * table * 4 / 2**20:.0f} MiB float32, "
              f"{args.popsize * table * 2 / 2**20:.0f} MiB bfloat16; peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
