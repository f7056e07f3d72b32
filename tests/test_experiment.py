"""The experiment skeleton: a new reproduction is its presets (settings and their flags), a plan
of run configs, `run_one` and a report; the one generic command gives it presets, flag checks,
the sweep flags, resume and the report. This file declares a toy one and drives it."""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from urpe.cli import OneLineParser
from urpe.cli_types import UsageError, positive_int
from urpe.experiments.command import resolve
from urpe.experiments.experiment import Experiment, Names, Option, Preset
from urpe.experiments.options import SEEDS, STEPS, WARMUP
from urpe.experiments.records import RunResult, RunSpec


@dataclass(frozen=True)
class ToyPreset(Preset):
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    warmup: int
    scale: int
    batch_size: int = 4
    precision: str = "32-true"


PRESETS = {
    "quick": ToyPreset(("double", "triple"), (0, 1), 10, 2, 1),
    "paper": ToyPreset(("double",), (0,), 100, 40, 5, precision="16-mixed"),
}
FACTORS = {"double": 2, "triple": 3}


def plan(settings: ToyPreset, precision: str, progress: bool = False) -> list[RunSpec]:
    return [
        RunSpec(
            f"{v}-seed{s}",
            {
                "experiment": "toy",
                "variant": v,
                "seed": s,
                "scale": settings.scale,
                "precision": precision,
            },
        )
        for v in settings.variants
        for s in settings.seeds
    ]


def run_one(config: dict, context) -> RunResult:
    return RunResult({"value": FACTORS[config["variant"]] * config["scale"] + config["seed"]})


def report(records: list[dict], out: Path, seconds: float) -> tuple[str, list[Path]]:
    values = sorted(r["result"]["value"] for r in records)
    (out / "results.json").write_text(json.dumps(values))
    (out / "results.md").write_text(f"values {values}\n")
    return f"values {values}", []


def check(settings: ToyPreset) -> None:
    if settings.scale > 50:
        raise UsageError("--scale", "too large")


TOY = Experiment(
    name="toy",
    presets=PRESETS,
    plan=plan,
    run_one=run_one,
    report=report,
    check=check,
    describe=lambda record: f"value {record['result']['value']}",
    sweep=("variants", "seeds"),
    variants=Option(
        ("--variants",),
        "variants",
        "comma-separated ({presets})",
        lambda text: tuple(text.split(",")),
        names=Names("variant", FACTORS),
    ),
    options=(
        SEEDS,
        STEPS,
        WARMUP,
        Option(("--scale",), "scale", "a factor ({presets})", positive_int),
    ),
)


def _args(*argv: str) -> argparse.Namespace:
    parser = OneLineParser(prog="urpe reproduce toy")
    TOY.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_override_the_preset_and_help_shows_every_presets_value(capsys):
    settings = resolve(TOY, _args("--preset", "paper", "--scale", "7", "--variants", "triple"))
    assert (settings.scale, settings.variants, settings.steps) == (7, ("triple",), 100)
    with pytest.raises(SystemExit):
        _args("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "a factor (quick: 1; paper: 5)" in text and "--accumulate-grad-batches" in text
    assert "quick: 32-true; paper: 16-mixed" in text


def test_the_warmup_keeps_its_share_when_only_the_steps_change():
    assert resolve(TOY, _args("--steps", "30")).warmup == 6
    assert resolve(TOY, _args("--steps", "30", "--warmup", "1")).warmup == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--variants", "double,quadruple"],
            "argument --variants: unknown variant quadruple; choose from double, triple",
        ),
        (["--steps", "5", "--warmup", "6"], "argument --warmup: 6 exceeds --steps 5"),
        (["--scale", "51"], "argument --scale: too large"),
    ],
)
def test_checks_name_the_flag(argv, message):
    with pytest.raises(UsageError) as error:
        resolve(TOY, _args(*argv))
    assert str(error.value) == message


def test_a_toy_reproduction_runs_resumes_and_reports(tmp_path, capsys):
    flags = (
        "--out",
        str(tmp_path),
        "--jobs",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--accelerator",
        "cpu",
    )
    assert TOY.run(_args(*flags)) == 0
    out = capsys.readouterr()
    assert "values [2, 3, 3, 4]" in out.out and "double-seed1: value 3" in out.err
    assert json.loads((tmp_path / "results.json").read_text()) == [2, 3, 3, 4]
    assert TOY.run(_args(*flags, "--resume", "--scale", "2")) == 0  # 4 new runs, 4 kept
    assert json.loads((tmp_path / "results.json").read_text()) == [2, 3, 3, 4, 4, 5, 6, 7]
    assert TOY.run(_args(*flags, "--resume")) == 0
    assert "4 of 4 runs already recorded" in capsys.readouterr().err
    (tmp_path / "results.json").unlink()
    assert TOY.run(_args("--out", str(tmp_path), "--report-only")) == 0
    assert json.loads((tmp_path / "results.json").read_text()) == [2, 3, 3, 4, 4, 5, 6, 7]


def test_the_report_reads_only_this_experiments_records(tmp_path, capsys):
    from urpe.experiments.records import RecordStore

    store = RecordStore(tmp_path)
    store.write(RunSpec("other", {"experiment": "lm"}), RunResult({"value": 99}), {}, 1.0)
    assert TOY.run(_args("--out", str(tmp_path), "--report-only")) == 1
    assert "no readable toy records" in capsys.readouterr().err
