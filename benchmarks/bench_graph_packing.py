"""Graphormer training steps, packed molecule batches against padded ones (issue 32, item 5).

python benchmarks/bench_graph_packing.py                          # moses-plogp, 64 molecules a step
python benchmarks/bench_graph_packing.py --datasets moses-plogp qm9 --threads 1
python benchmarks/bench_graph_packing.py --datasets zinc --zinc-dir DIR --json out.json

Prints, per dataset and route (padded; packed in rows of the largest molecule, of fixed
lengths, and in one row per batch), the step time (median, interleaved), its ratio to padded,
the rows, tokens and attention pairs a batch takes, and the largest difference from the padded
predictions (every route computes the same function). See harness/graph_packing.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from harness.graph_packing import ONE_ROW, GraphBenchSettings, run_graph_bench


def main(argv: list[str] | None = None) -> int:
    defaults = GraphBenchSettings()
    parser = argparse.ArgumentParser(
        prog="bench_graph_packing.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=[defaults.dataset],
        help="moses-plogp, qm9, zinc, zinc-full (zinc needs --zinc-dir)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="molecules per step"
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=defaults.batches,
        help="distinct batches the steps cycle through",
    )
    parser.add_argument("--model", default=defaults.model, help="Graphormer preset")
    parser.add_argument(
        "--repeats", type=int, default=defaults.repeats, help="timed steps per route (median)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--zinc-dir", default=None, help="PyG's raw ZINC files")
    parser.add_argument(
        "--pack-lengths",
        nargs="+",
        type=int,
        default=[0, 64, ONE_ROW],
        help="packed rows' lengths in inputs; 0: the batch's largest molecule, "
        f"{ONE_ROW}: one row per batch",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for dataset in args.datasets:
        lengths = tuple(p or None for p in args.pack_lengths)
        settings = GraphBenchSettings(
            dataset, args.batch_size, args.batches, args.model, args.repeats, args.zinc_dir, lengths
        )
        r = run_graph_bench(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
        results.append(r)
        f = r["facts"]
        print(
            f"{dataset}: {args.batch_size} molecules a step, {f['nodes_mean']:.1f} nodes on "
            f"average, largest {f['nodes_max']:.1f}; {r['threads']} threads"
        )
        for name, ms in r["time_ms"].items():
            route = f["routes"][name]
            print(
                f"  {name:12s} {ms:8.1f} ms  x{r['ratio'][name]:.3f}  rows {route['rows']:5.1f}"
                f"  tokens {route['tokens']:7.0f}  pairs {route['pairs']:9.0f}  predictions "
                f"differ by {r['max_prediction_difference'][name]:.1e}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
