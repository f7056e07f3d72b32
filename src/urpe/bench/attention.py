"""`urpe bench attention`: time and peak memory of the attention kernels against PyTorch SDPA.

The rows (`rows`) are every registered backend with and without URPE's gate plus the external
baselines (SDPA, SDPA with a dense bias, FlexAttention); one pipeline (`measure`) times them on
the CPU (`cpu`: interleaved wall-clock medians, optionally under contention) or on CUDA (`cuda`:
`triton.testing.do_bench`). Targets are data (`targets`); the report is BENCHMARKS.md (`report`,
`gpu_section`), the JSON results and a memory plot. See benchmarks/README.md.

The flags (`options`) are declared without torch, so that `--help` answers at once; the
measuring modules are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_arguments, fill_defaults


def command_line() -> str:
    """The command as typed, for the report (`urpe bench attention ...`)."""
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "attention"]:
        argv = argv[2:]
    return " ".join(["urpe bench attention", *argv])


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from . import cpu, cuda, gpu_section
    from .memory import probe

    if args.memory_probe:
        print(json.dumps(dict(peak_mb=probe(args.memory_probe))))
        return 0
    fill_defaults(args)
    if args.gpu_report:
        return gpu_section.report(args.gpu_report, args.markdown)
    device = cuda if args.device == "cuda" else cpu
    return device.run(args, progress, command_line())


__all__ = ["add_arguments", "run"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="urpe bench attention")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
