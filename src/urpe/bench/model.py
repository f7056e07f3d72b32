"""`urpe bench model`: what URPE costs inside a model, not in one long call (issue 28).

One run measures, on the CPU, every group of `model_groups` as ratios to a baseline measured
in the same run: one decoding call against SDPA (microseconds over it), short rows forward and
backward, bfloat16 long rows, greedy generation with the library's decoder and with a Hugging
Face Llama (eager, and static cache under torch.compile), a training step of that Llama, the
end-to-end rows of `urpe bench attention` and the LM experiment's step times. Each group is
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

import torch

from ..cli_types import UsageError
from .contention import Condition, busy_core_index
from .machine import cpu_info
from .measure import failure_reason
from .model_groups import groups
from .model_options import add_arguments
from .model_report import section_markdown
from .model_sizes import FULL, QUICK
from .model_targets import judge
from .sections import MODEL
from .timed import compare


def command_line() -> str:
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "model"]:
        argv = argv[2:]
    return " ".join(["urpe bench model", *argv])


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
                with condition.applied():
                    block = built.measure(repeats, say)
                records += [dict(r, group=name, **condition.fields) for r in block]
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
            f"{label} {'n/a' if v is None else f'{v:.2f}'}" for label, v in t["values"].items()
        )
        unit = " us" if t["measure"] == "extra_us" else ""
        print(f"{t['target']}: {values} (limit {t['limit']:.3g}{unit}, met: {t['met']})")


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


def run(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 9)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    conditions = [Condition(threads, busy=c == "busy") for c in args.conditions]
    if len({c.busy for c in conditions}) != len(conditions):
        raise UsageError("--conditions", "name each condition once")
    results = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command_line(),
        sizes_name="quick" if args.quick else "full",
        sizes=asdict(sizes),
        repeats=repeats,
        load_start=os.getloadavg(),
        busy_core=busy_core_index() if "busy" in args.conditions else None,
        conditions=[c.fields for c in conditions],
    )
    registry = groups(args.compile_backend)
    results.update(measure_groups(registry, args.groups, sizes, conditions, repeats, progress))
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


__all__ = ["add_arguments", "run"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="urpe bench model")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
