"""The `urpe` command (also `python -m urpe`). Each subcommand lives in its own module, imported
only when used, so `urpe --help` stays fast and the core never imports the training stack.

A subcommand is a module, or an object named "module:NAME" (a reproduction's `CommandLine`), that
provides `add_arguments(parser)` and `run(args) -> int`.

Errors a user can cause never show a traceback: a bad argument prints one line naming it and
exits with status 2 (argparse's errors, and `UsageError` raised by a command); a missing
optional dependency prints the one `pip install` line that fixes it (status 2); Ctrl-C prints
one line (status 130). When whatever reads stdout goes away (`urpe predict ... | head`), the
command stops quietly with status 141, as a program killed by SIGPIPE does (what the shell
reports for `seq 100000 | head`): no traceback, and the unwritten output goes to /dev/null.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .cli_types import UsageError
from .extras import what_to_install
from .startup import thaw

# (group, name) -> (module, one-line help)
COMMANDS = {
    ("reproduce", "synthetic"): (
        "urpe.experiments.synthetic.presets:COMMAND",
        "the paper's synthetic tasks (PI, ETP) and Su's probe, every encoding variant",
    ),
    ("reproduce", "lm"): (
        "urpe.experiments.lm.presets:COMMAND",
        "language modelling on real text: every encoding, Transformer-XL memory, URPE's gate, "
        "length extrapolation",
    ),
    ("reproduce", "long-context"): (
        "urpe.experiments.long_context.presets:COMMAND",
        "how far each encoding reaches: passkey, needles, recall, copying, variable tracking "
        "and perplexity at 1x-8x the training length",
    ),
    ("reproduce", "graph"): (
        "urpe.experiments.graph.presets:COMMAND",
        "Graphormer vs Graphormer + URPE on real molecules (MOSES, QM9, or your ZINC files)",
    ),
    ("bench", "attention"): (
        "urpe.bench.attention",
        "time and peak memory of the attention kernels against PyTorch SDPA",
    ),
}

# Top-level commands: name -> (module, one-line help).
SINGLE_COMMANDS = {
    "generate": (
        "urpe.experiments.lm.generate",
        "sample text from a trained language model checkpoint, streamed token by token",
    ),
    "finetune": (
        "urpe.experiments.finetune.presets:COMMAND",
        "fine-tune a local Hugging Face causal LM with and without URPE gates (loss, curves, "
        "length extrapolation)",
    ),
    "predict": (
        "urpe.experiments.predict",
        "predict a trained graph model's target for new SMILES (a CSV out)",
    ),
    "evaluate": (
        "urpe.experiments.evaluate",
        "score a trained model on new data: bpc/perplexity of a text, MAE on molecules, "
        "accuracy on a task",
    ),
}

# Named modes of a top-level command, with flags of their own: (command, mode) -> (module, help).
# `urpe evaluate long-context MODEL` is not `urpe evaluate RUN DATA` with RUN "long-context".
COMMAND_MODES = {
    ("evaluate", "long-context"): (
        "urpe.experiments.long_context.evaluate",
        "passkey, needles, recall, copying, variable tracking and perplexity at many lengths, "
        "on any trained causal LM (urpe or Hugging Face)",
    ),
}

# Exit status when stdout's reader has gone: 128 + SIGPIPE, as the shell reports for a program
# that the signal ended.
PIPE_CLOSED_STATUS = 141

GROUP_HELP = {
    "reproduce": "reproduce a paper's experiment and write tables and plots",
    "bench": "measure speed and memory",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ("prog: error: ...") instead of the usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command(target: str):
    """The module, or "module:NAME" object, that implements a subcommand."""
    module, _, name = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, name) if name else loaded


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full parser; only the subcommand named in argv gets its (lazily imported) arguments."""
    parser = OneLineParser(
        prog="urpe",
        description="Transformers with universal relative positional encodings (URPE).",
    )
    parser.add_argument("--version", action="version", version=f"urpe {__version__}")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    subparsers = {}
    for group, help_text in GROUP_HELP.items():
        group_parser = groups.add_parser(group, help=help_text, description=help_text)
        subparsers[group] = group_parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, (module, help_text) in SINGLE_COMMANDS.items():
        sub = groups.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module=module, prog=sub.prog)
        mode = COMMAND_MODES.get((name, argv[1])) if argv[:1] == [name] and argv[1:] else None
        if mode is not None:
            modes = sub.add_subparsers(dest="mode", metavar="MODE", required=True)
            mode_parser = modes.add_parser(argv[1], help=mode[1], description=mode[1])
            mode_parser.set_defaults(module=mode[0], prog=mode_parser.prog)
            _command(mode[0]).add_arguments(mode_parser)
        elif argv[:1] == [name]:
            _command(module).add_arguments(sub)
    for (group, name), (module, help_text) in COMMANDS.items():
        sub = subparsers[group].add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module=module, prog=sub.prog)
        if argv[:2] == [group, name]:
            _command(module).add_arguments(sub)
    return parser


def _reader_gone(stream) -> bool:
    """Whether `stream` is a pipe (or socket) whose reading end has closed."""
    import select

    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation, closed: no file
        return False
    if not hasattr(select, "poll"):  # Windows: no way to ask; a broken pipe there is stdout's
        return True
    poller = select.poll()
    poller.register(fd, 0)  # errors only: POLLERR is reported for a pipe without a reader
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so what is still buffered in `sys.stdout`
    can be flushed at exit without "Exception ignored ... BrokenPipeError"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run the `urpe` command line `argv` (default: sys.argv[1:]); returns the exit status."""
    try:
        try:
            status = _main(argv)
        except SystemExit:  # --help, --version and argparse's errors: their output, flushed
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise
        _discard_stdout()
        return PIPE_CLOSED_STATUS
    finally:
        thaw()  # what a command froze at its start is collected again (`urpe.startup`)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SINGLE_COMMANDS:
        prog = f"urpe {argv[0]}"
    else:
        prog = "urpe " + " ".join(argv[:2]) if len(argv) >= 2 else "urpe"
    try:
        args = build_parser(argv).parse_args(argv)
        prog = args.prog
        return int(_command(args.module).run(args) or 0)
    except UsageError as error:
        print(f"{prog}: error: {error} (see {prog} --help)", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        problem = what_to_install(error)
        if problem is None:
            raise
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
