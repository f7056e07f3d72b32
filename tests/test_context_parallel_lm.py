"""`urpe reproduce lm --context-parallel N`: runs that split each segment across processes
refuse what they cannot run in one line, and 2 processes (started by the command itself, or by
torchrun; with 4, two data-parallel groups of 2) record the same per-step training and
validation losses as one process."""

import json
import subprocess
import sys

import pytest

from urpe.cli import main

from .tiny import tiny_flags

# 6 updates, each logged (runs of up to 20 updates log every one), validated after 3 and 6
RUN = tiny_flags("lm", steps=6, val_every=3)


BAD = [
    (
        ["--variants", "txl", "--context-parallel", "2"],
        "argument --context-parallel: context parallelism carries no memory; variants txl use it",
    ),
    (
        ["--context-parallel", "3"],
        "argument --context-parallel: segments of 16 tokens do not split into the 6 equal "
        "chunks of 3 processes (zigzag): choose --segment-length a multiple of 6",
    ),
    (
        ["--context-parallel", "2", "--devices", "3", "--accelerator", "cpu"],
        "argument --context-parallel: 2 processes per sequence do not divide the 3 processes",
    ),
    (
        ["--context-parallel", "2", "--devices", "4", "--batch-size", "3"],
        "argument --batch-size: 3 sequences per update do not split into 2 processes",
    ),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_context_parallel_refuses_what_it_cannot_run_in_one_line(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["reproduce", "lm", *RUN, *flags, "--out", str(out)]) == 2  # checked, not parsed
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_only_experiments_that_split_sequences_offer_the_flag(capsys):
    assert "--context-parallel N" in _help(["reproduce", "lm", "--help"], capsys)
    assert "--context-parallel" not in _help(["reproduce", "synthetic", "--help"], capsys)


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def _losses(out) -> dict:
    (path,) = (out / "records").glob("*.json")
    result = json.loads(path.read_text())["result"]
    return {"train": result["curve"]["train"], "val": result["curve"]["val"]}


def _equal_step_for_step(split: dict, whole: dict) -> None:
    assert [s for s, _ in split["train"]] == [float(s) for s in range(1, 7)]
    for part in ("train", "val"):
        assert [s for s, _ in split[part]] == [s for s, _ in whole[part]]
        for (step, a), (_, b) in zip(split[part], whole[part], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (part, step, a, b)  # float32 sums, reordered


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    assert main(["reproduce", "lm", *RUN, "--out", str(out)]) == 0
    return _losses(out)


def _run(command: list[str], cwd) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]


# In a subprocess: Lightning starts the other ranks by running the command line again, which
# must be `urpe`'s, not pytest's.
CONTEXT_PARALLEL = ["-m", "urpe", "reproduce", "lm", *RUN, "--context-parallel", "2"]


@pytest.mark.slow  # two Lightning runs of a minute or two each on a loaded 2-core machine
@pytest.mark.parametrize("devices", [2, 4])  # 4: data parallel 2 x context parallel 2
def test_two_processes_per_sequence_record_the_losses_of_one(devices, one_process, tmp_path):
    out = tmp_path / "split"
    command = [sys.executable, *CONTEXT_PARALLEL, "--devices", str(devices), "--out", str(out)]
    _run(command, tmp_path)
    _equal_step_for_step(_losses(out), one_process)


@pytest.mark.slow
def test_under_torchrun_two_processes_record_the_losses_of_one(one_process, tmp_path):
    out = tmp_path / "torchrun"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    _run([*torchrun, "2", *CONTEXT_PARALLEL, "--out", str(out)], tmp_path)
    _equal_step_for_step(_losses(out), one_process)
