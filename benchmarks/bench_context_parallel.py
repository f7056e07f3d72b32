"""Context parallelism on CPU processes (issue 40): memory per rank and step time at N = 1, 2, 4.

python benchmarks/bench_context_parallel.py             # L = 8192, N = 1 2 4: prints the table
python benchmarks/bench_context_parallel.py --report    # and writes it into ../BENCHMARKS.md
python benchmarks/bench_context_parallel.py --length 2048 --processes 1 2 --repeats 1   # quick

One training step (forward and backward, next-token loss) of a 2-layer causal Transformer with
URPE (Toeplitz bias and gate) on one sequence of --length tokens, split across N gloo
processes by `urpe.distributed` (zigzag layout; N = 1 is the model on one process). Prints per N
the activations autograd saves per rank, the rise of each rank's peak resident memory during
its first step, and the median step time of the slowest rank. See harness/context_parallel.py
for what each number counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from datetime import datetime, timezone
from pathlib import Path

from harness import scripts
from harness.context_parallel import ContextParallelSettings, run_sizes, table
from harness.sections import CONTEXT_PARALLEL

ROOT = Path(__file__).resolve().parents[1]


def _parser():
    defaults = ContextParallelSettings()
    parser = scripts.parser("bench_context_parallel.py", __doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=defaults.length, help="tokens")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed steps")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="per process")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2, 4], help="the N to measure"
    )
    parser.add_argument("--json", type=Path, help="write every rank's record here")
    parser.add_argument(
        "--report", action="store_true", help="write the section into ../BENCHMARKS.md"
    )
    return parser


def _check(args) -> None:
    for n in args.processes:
        if n < 1 or args.length % (2 * n):
            raise scripts.UsageError(
                "--processes",
                f"{n} processes split {args.length} tokens into 2N equal chunks (zigzag) only "
                f"where --length is a multiple of {2 * n}",
            )


def _paragraph(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), 96, break_on_hyphens=False)


def section(rows: list[dict], settings: ContextParallelSettings, load: str, command: str,
            when: str) -> str:  # fmt: skip
    """The BENCHMARKS.md section, markers included."""
    s = settings
    setup = _paragraph(
        f"`{command}` ({when}). One training step (forward and backward) of a causal "
        f"Transformer with URPE (Toeplitz bias and gate; {s.layers} layers, width {s.dim}, "
        f"{s.heads} heads, vocabulary {s.vocab}) on one sequence of {s.length} tokens (batch "
        f"{s.batch}), split across N gloo processes on this machine's CPU by "
        f"`urpe.distributed` ({s.layout} layout); N = 1 is the same model on one process "
        f"without a group. {s.threads} thread(s) per process."
    )
    machine = _paragraph(
        f"Machine load when measured (`uptime`): `{load}`. This is a shared 2-core VM with "
        "other engineers' jobs running: N processes compete for 2 cores with them, so the step "
        "times above measure contention as much as the method (the ring's work per rank falls "
        "~1/N, but 4 processes on 2 busy cores cannot run at once). Read the memory columns as "
        "the result, the step times only as what this machine gave."
    )
    body = f"""## Context parallel (CPU processes)

{setup}

- saved activations: what autograd keeps for backward on a rank (distinct storages, parameters
  excluded), on its first step. This is the activation memory that context parallelism divides.
- peak RSS rise: how far that first step raised the rank's peak resident memory (transient
  buffers, keys in flight and allocator slack included): noisier, an upper view.
- step: median of {s.repeats} steps of the slowest rank, the ranks starting each step together.

{table(rows)}

{machine}
"""
    return f"{CONTEXT_PARALLEL.begin}\n{body}{CONTEXT_PARALLEL.end}\n"


def run(args) -> int:
    _check(args)
    settings = ContextParallelSettings(
        length=args.length, layers=args.layers, dim=args.dim, heads=args.heads,
        repeats=args.repeats, threads=args.threads,
    )  # fmt: skip
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        rows = run_sizes(
            settings, args.processes, Path(folder), lambda m: print(m, file=sys.stderr)
        )
    print(table(rows))
    print(f"load before the run: {load}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(settings), "rows": rows}, indent=1))
    if args.report:
        flags = [f for f in sys.argv[1:] if f not in ("--report", "--json", str(args.json))]
        command = " ".join(["python benchmarks/bench_context_parallel.py", *flags])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        text = section(rows, settings, load, command, when)
        CONTEXT_PARALLEL.write(ROOT / "BENCHMARKS.md", text)
        print(f"wrote the section into {ROOT / 'BENCHMARKS.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return scripts.main(_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
