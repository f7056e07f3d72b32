"""The `urpe` command. Each subcommand lives in its own module, imported only when used, so
`urpe --help` stays fast and the core never imports the training stack.

A subcommand module provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (group, name) -> (module, one-line help)
COMMANDS = {
    ("reproduce", "synthetic"): (
        "urpe.experiments.synthetic.command",
        "the paper's synthetic tasks (PI, ETP) and Su's probe, every encoding variant",
    ),
    ("bench", "attention"): (
        "urpe.bench.attention",
        "time and peak memory of the attention kernels against PyTorch SDPA",
    ),
}

GROUP_HELP = {
    "reproduce": "reproduce a paper's experiment and write tables and plots",
    "bench": "measure speed and memory",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full parser; only the subcommand named in argv gets its (lazily imported) arguments."""
    parser = argparse.ArgumentParser(
        prog="urpe",
        description="Transformers with universal relative positional encodings (URPE).",
    )
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    subparsers = {}
    for group, help_text in GROUP_HELP.items():
        group_parser = groups.add_parser(group, help=help_text, description=help_text)
        subparsers[group] = group_parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for (group, name), (module, help_text) in COMMANDS.items():
        sub = subparsers[group].add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        sub.set_defaults(module=module)
        if argv[:2] == [group, name]:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args.module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
