"""The model benchmark (`make bench-model`, benchmarks/bench_model.py): what URPE costs inside
a model, not in one long call (issue 28).

One run measures, on the CPU, every group of `model_groups` as ratios to a baseline measured
in the same run: one decoding call against SDPA (microseconds over it), short rows forward and
backward, bfloat16 long rows, greedy generation with the library's decoder and with a Hugging
Face Llama (eager, and static cache under torch.compile), a training step of that Llama, the
end-to-end steps of the attention report and the LM experiment's step times. Each group is
built once, then timed idle and with another process spinning on one core. The targets are
printed (measured, limit, met); the report goes between markers into BENCHMARKS.md (the rest of
the file stays), every number into a JSON file. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from urpe.bench.machine import StolenTime, cpu_info, keep_freed_memory
from urpe.bench.measure import failure_reason
from urpe.cli_types import UsageError, non_negative_int, positive_int

from .contention import Condition, busy_core_index
from .model_groups import GROUP_NAMES, groups
from .model_report import limit_cell, section_markdown, spread
from .model_sizes import FULL, QUICK
from .model_targets import condition_label, judge
from .processes import in_fresh_processes, merged_records
from .sections import MODEL
from .timed import compare

CONDITIONS = ("idle", "busy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--quick",
        action="store_true",
        help="tiny sizes and few repeats: a smoke run of every group in seconds (plus the "
        "compile of hf_compiled; see --compile-backend); its numbers mean nothing",
    )
    add(
        "--groups",
        nargs="+",
        choices=GROUP_NAMES,
        default=list(GROUP_NAMES),
        metavar="GROUP",
        help=f"what to measure (default: all): {', '.join(GROUP_NAMES)}",
    )
    add(
        "--conditions",
        nargs="+",
        choices=CONDITIONS,
        default=list(CONDITIONS),
        help="idle, and/or with a child process spinning on one core (default: both)",
    )
    add(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed repeats per row, median (default: 9, with --quick 2)",
    )
    add(
        "--processes",
        type=positive_int,
        default=1,
        help="run everything in this many fresh processes, one after another, and report "
        "each figure as the median over them (its range beside it): a ratio that is steady "
        "within a process can move by 10-20%% between processes (default 1: this one)",
    )
    add(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch threads (default 0: torch's default)",
    )
    add(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of hf_compiled (default inductor: what transformers "
        "uses; 'eager' traces without generating code, for a fast smoke run)",
    )
    add("--json", type=Path, help="write every record, the sizes and the targets here")
    add(
        "--markdown",
        type=Path,
        help="write the model section into this file (BENCHMARKS.md), "
        "between its markers; the rest of the file stays",
    )


def command_line() -> str:
    """The command as typed, for the report."""
    return " ".join(["python benchmarks/bench_model.py", *sys.argv[1:]])


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure_groups(registry: dict, names, sizes, conditions, repeats, say) -> dict:
    """{records: of every group under every condition, groups: name -> what the report says
    of it (title, baseline, unit, what its cases share, and why it stopped if it failed)}. A
    group is built once (idle), then timed under each condition in turn; one that fails keeps
    the records it has, and the run goes on with the next."""
    records, info = [], {}
    for name in names:
        group = registry[name]
        info[name] = dict(title=group.title, baseline=group.baseline, unit=group.unit)
        say(f"{name}: building")
        try:
            built = group.build(sizes, say)
            info[name]["about"] = built.about
            for condition in conditions:
                say(f"{name}: timing, {condition.label}")
                with condition.applied(), StolenTime() as stolen:
                    block = built.measure(repeats, say)
                records += [dict(r, group=name, **condition.fields) for r in block]
                if stolen.fraction is not None:
                    say(f"{name}: the host took {100 * stolen.fraction:.1f}% of the CPU time")
                    info[name].setdefault("stolen", {})[condition_label(condition.fields)] = (
                        stolen.fraction
                    )
        except Exception as error:  # noqa: BLE001 - one group failing must not stop the rest
            info[name]["failed"] = failure_reason(error)
            say(f"{name}: stopped ({info[name]['failed']})")
        built = None  # its models go before the next group's are built
    compare(records, {name: group.baseline for name, group in registry.items()})
    return dict(records=records, groups=info)


def machine() -> dict:
    info = cpu_info()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        values = ", ".join(
            f"{label} {'n/a' if v is None else f'{v:.2f}'}{spread(t, label)}"
            for label, v in t["values"].items()
        )
        if t["limit"] is None:
            print(f"{t['target']}: {values} (a control: no limit)")
        else:
            print(f"{t['target']}: {values} (limit {limit_cell(t)}, met: {t['met']})")


def print_records(records: list[dict]) -> None:
    for r in records:
        where = f"{r['group']:11s} {r['case']:11s} {r['name']:15s} {r['mode']:8s} "
        where += "busy " if r["busy"] else "idle "
        if "time_ms" not in r:
            print(f"{where} skipped: {r['skipped']}")
            continue
        line = f"{where} {r['time_ms']:10.3f} ms"
        if "ratio" in r:
            line += f"  x{r['ratio']:.2f}  {r['extra_us']:+9.1f} us"
        print(line)


def _sizes_and_repeats(args: argparse.Namespace) -> tuple:
    return (QUICK if args.quick else FULL), args.repeats or (2 if args.quick else 9)


def _conditions(args: argparse.Namespace) -> list[Condition]:
    threads = torch.get_num_threads()
    conditions = [Condition(threads, busy=c == "busy") for c in args.conditions]
    if len({c.busy for c in conditions}) != len(conditions):
        raise UsageError("--conditions", "name each condition once")
    return conditions


def measure(args: argparse.Namespace) -> dict:
    """This process's measurements of the groups the arguments name: `measure_groups`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    sizes, repeats = _sizes_and_repeats(args)
    registry = groups(args.compile_backend)
    return measure_groups(registry, args.groups, sizes, _conditions(args), repeats, progress)


def merged_runs(runs: list[dict]) -> dict:
    """`measure_groups` results of several processes as one (`processes.merged_records`): a
    group failed where it failed in any run; the host's steal is the most any run saw."""
    groups_info = {}
    for name, info in runs[0]["groups"].items():
        info = {key: value for key, value in info.items() if key != "stolen"}
        stolen: dict[str, float] = {}
        for run_ in runs:
            other = run_["groups"].get(name, {})
            if "failed" in other:
                info.setdefault("failed", other["failed"])
            for label, fraction in other.get("stolen", {}).items():
                stolen[label] = max(stolen.get(label, 0.0), fraction)
        if stolen:
            info["stolen"] = stolen
        groups_info[name] = info
    return dict(records=merged_records([r["records"] for r in runs]), groups=groups_info)


def run(args: argparse.Namespace) -> int:
    sizes, repeats = _sizes_and_repeats(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"allocator: {keep_freed_memory()}", flush=True)
    conditions = _conditions(args)
    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command_line(),
        sizes_name="quick" if args.quick else "full",
        sizes=asdict(sizes),
        repeats=repeats,
        processes=args.processes,
        load_start=os.getloadavg(),
        busy_core=busy_core_index() if "busy" in args.conditions else None,
        conditions=[c.fields for c in conditions],
    )
    if args.processes == 1:
        results.update(measure(args))
    else:
        results.update(merged_runs(in_fresh_processes(measure, args, args.processes)))
    results["machine"] = machine()
    results["targets"] = judge(results["records"], results["conditions"])
    print_records(results["records"])
    print_targets(results["targets"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        MODEL.write(args.markdown, section_markdown(results))
    return 0


__all__ = ["add_arguments", "measure", "merged_runs", "run"]
