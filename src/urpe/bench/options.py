"""The flags of `urpe bench attention`, and the defaults that depend on --device. Declaring them
imports no torch (`--help` answers at once); the rows asked for are checked against the backends
available here, and the default rows chosen, when the command runs (`fill_defaults`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_types import UsageError, non_negative_int, positive_int
from .rows import RENAMED, offered_rows

DTYPES = ("float32", "bfloat16", "float16")
# Defaults that depend on --device (flags left out on the command line take these).
DEVICE_DEFAULTS = {
    "cpu": dict(
        lengths=[512, 2048, 8192],
        dtypes=["float32", "bfloat16"],
        batch=1,
        heads=8,
        dense_max_length=4096,
        blockwise_max_length=None,
    ),
    "cuda": dict(
        lengths=[1024, 2048, 4096, 8192, 16384],
        dtypes=["bfloat16"],
        batch=4,
        heads=16,
        dense_max_length=8192,
        blockwise_max_length=8192,
    ),
}


# The flags that name rows, and the device whose rows each takes.
ROW_FLAGS = {"rows": "cpu", "gpu_rows": "cuda", "profile_row": "cpu"}


def _row_help(device: str) -> str:
    return "; ".join(f"{name}: {row.help}" for name, row in offered_rows(device).items())


def _rows(parser, flag: str, device: str, text: str) -> None:
    choices = list(offered_rows(device))
    parser.add_argument(
        flag,
        nargs="+",
        default=argparse.SUPPRESS,  # the rows of the targets, known when the command runs
        choices=choices,
        type=lambda name: RENAMED.get(name, name),
        metavar="ROW",
        help=f"{text} (default: the baselines, every URPE row, and the RPE rows of the kernels "
        f"'auto' runs, which show what the gate costs). {_row_help(device)}",
    )


def _device_default(parser, flag: str, what: str, *old_flags: str, **kwargs) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    cpu, cuda = DEVICE_DEFAULTS["cpu"][dest], DEVICE_DEFAULTS["cuda"][dest]
    parser.add_argument(
        flag,
        *old_flags,
        dest=dest,
        default=argparse.SUPPRESS,
        help=f"{what} (default: cpu {cpu}, cuda {cuda})",
        **kwargs,
    )


def _lengths(parser, flag: str, default: list[int], what: str) -> None:
    """A flag taking one or more positive integers."""
    parser.add_argument(flag, type=positive_int, nargs="+", default=default, help=what)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the --rows at every --lengths and --dtypes, peak memory per call and a "
        "profile. cuda: the --gpu-rows (Triton kernel, FlexAttention route, SDPA-Flash) over "
        "--lengths x --head-dims x --causal",
    )
    _device_default(parser, "--lengths", "sequence lengths to time", type=positive_int, nargs="+")
    _device_default(
        parser,
        "--dtypes",
        "input dtypes (the blockwise kernel computes in float32)",
        nargs="+",
        choices=DTYPES,
    )
    _rows(parser, "--rows", "cpu", "CPU kernels to measure")
    _rows(parser, "--gpu-rows", "cuda", "GPU kernels to measure (--device cuda)")
    _lengths(
        parser,
        "--head-dims",
        [64, 128],
        "head widths D for --device cuda (the CPU report uses --head-dim)",
    )
    add(
        "--causal",
        choices=("both", "yes", "no"),
        default="both",
        help="causal settings for --device cuda",
    )
    add(
        "--time-budget",
        type=positive_int,
        default=540,
        metavar="SECONDS",
        help="--device cuda: start no new setting after this many seconds (those left are "
        "recorded as not measured), so one command fits a time limit",
    )
    _device_default(
        parser,
        "--blockwise-max-length",
        "skip the pure-PyTorch blockwise kernel above this length (--fused-max-length: its "
        "old name)",
        "--fused-max-length",
        type=positive_int,
    )
    _device_default(parser, "--batch", "batch size B", type=positive_int)
    _device_default(parser, "--heads", "heads H", type=positive_int)
    add("--head-dim", type=positive_int, default=64, help="head width D")
    add("--repeats", type=positive_int, default=5, help="timed repeats (median)")
    add("--warmup", type=non_negative_int, default=1, help="untimed calls first")
    add(
        "--reference-max-length",
        type=positive_int,
        default=4096,
        help="skip the reference above this length (its (L, L) matrices would not fit)",
    )
    add(
        "--reference-memory-max-length",
        type=positive_int,
        default=8192,
        help="the same limit for the peak-memory probe (a subprocess: if it runs out of memory "
        "the point is reported as failed and the curve extrapolated)",
    )
    _device_default(
        parser,
        "--dense-max-length",
        "skip SDPA with a dense bias above this length",
        type=positive_int,
    )
    add(
        "--memory-lengths",
        type=positive_int,
        nargs="*",
        default=[512, 1024, 2048, 4096, 8192],
        help="lengths for the peak-memory curves, float32 forward+backward (none: skip)",
    )
    add(
        "--profile",
        type=non_negative_int,
        default=2048,
        metavar="L",
        help="profile --profile-row's forward+backward (float32) at this length and report "
        "the operators it spends its time in (0: skip)",
    )
    add(
        "--profile-row",
        metavar="ROW",
        choices=list(offered_rows("cpu")),
        help="the CPU row --profile profiles (default: cpp_urpe, what 'auto' runs for URPE on "
        "the CPU, or blockwise_urpe where the C++ kernel is not built; blockwise_urpe shows the "
        "eager kernel's operators)",
    )
    add("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    add("--json", type=Path, help="write every record (times, memory, profile) here")


def fill_defaults(args: argparse.Namespace) -> None:
    """Flags left out take the chosen device's defaults; the rows asked for must run here."""
    from .rows import default_rows, rows_for

    for name, value in DEVICE_DEFAULTS[args.device].items():
        if not hasattr(args, name):
            setattr(args, name, value)
    for name, device in ROW_FLAGS.items():
        available = rows_for(device)
        if not hasattr(args, name):
            setattr(args, name, default_rows(device))
        asked = getattr(args, name)
        missing = [
            row
            for row in ([asked] if isinstance(asked, str) else asked or ())
            if row not in available
        ]
        if missing:
            raise UsageError(
                f"--{name.replace('_', '-')}",
                f"{', '.join(missing)} cannot run here; choose from {', '.join(available)}",
            )
