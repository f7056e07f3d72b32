"""The shared sweep runner: identity, resume, atomic records, parallel = sequential, reports
that never average different settings."""

import json

import pytest

from urpe.cli import main
from urpe.experiments.runner import RunSpec, config_digest
from urpe.experiments.synthetic.report import rows, summarize

from .tiny import tiny_flags

TINY = tiny_flags(
    "synthetic", tasks="pi,probe", variants="nope,urpe", steps=12, eval_sequences=32, jobs=None
)


def _sweep(out, *flags):
    assert main(["reproduce", "synthetic", "--out", str(out), *TINY, *flags]) == 0
    return {
        r["id"]: r for r in (json.loads(p.read_text()) for p in (out / "records").glob("*.json"))
    }


def test_identity_is_the_whole_config():
    a = RunSpec("x", {"model": {"dim": 16}, "seed": 0})
    b = RunSpec("x", {"seed": 0, "model": {"dim": 16}})  # key order does not matter
    c = RunSpec("x", {"model": {"dim": 64}, "seed": 0})
    assert a.id == b.id != c.id and a.id.startswith("x-")
    assert config_digest(a.config) == config_digest(b.config)


@pytest.mark.slow
def test_parallel_sweep_equals_sequential(tmp_path):
    sequential = _sweep(tmp_path / "seq", "--jobs", "1")
    parallel = _sweep(tmp_path / "par", "--jobs", "2")
    assert sequential.keys() == parallel.keys() and len(sequential) == 4
    for key, record in sequential.items():
        assert record["result"] == parallel[key]["result"]
    assert {r["execution"]["jobs"] for r in parallel.values()} == {2}


def test_resume_skips_only_exact_matches_and_reports_them_apart(tmp_path, capsys):
    out = tmp_path / "out"
    first = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe")
    again = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume")
    assert again == first  # nothing retrained: the record file is untouched
    assert "1 of 1 runs already recorded" in capsys.readouterr().err
    # A different width is a different run: --resume trains it, and the report keeps them apart.
    both = _sweep(
        out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume", "--dim", "8"
    )
    assert len(both) == 2
    table = rows(list(both.values()))
    labels = sorted(r["label"] for r in table)
    assert labels == ["urpe (model.transformer.dim=16)", "urpe (model.transformer.dim=8)"]
    assert all(s["n"] == 1 for s in summarize(table).values())
    text = (out / "results.md").read_text()
    assert "| urpe (model.transformer.dim=8) |" in text and "(n=2)" not in text


@pytest.mark.parametrize("damage", [b"", b'{"format": "urpe-record/2", "id": "x", "conf', b"\x80"])
def test_a_corrupt_record_is_named_and_its_run_trained_again(tmp_path, capsys, damage):
    out = tmp_path / "out"
    (record,) = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe").values()
    path = out / "records" / f"{record['id']}.json"
    path.write_bytes(damage)
    capsys.readouterr()
    again = _sweep(out, "--jobs", "1", "--variants", "urpe", "--tasks", "probe", "--resume")
    err = capsys.readouterr().err
    assert str(path) in err and "training probe-urpe" in err and "Traceback" not in err
    assert again[record["id"]]["result"] == record["result"]


def test_a_sequential_sweep_gives_back_the_callers_thread_count(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _sweep(tmp_path / "out", "--jobs", "1", "--variants", "urpe", "--tasks", "probe")
        assert torch.get_num_threads() == 2  # the sweep ran with --threads 1
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# The runner's own API, without a model: `sweep` with module-level toy `run_one`s (spawned
# workers import them by name), the record store, and the training config an execution makes.

from urpe.experiments.execution import Execution, RunContext  # noqa: E402
from urpe.experiments.records import RecordStore, RunResult  # noqa: E402
from urpe.experiments.runner import SweepInterrupted, sweep  # noqa: E402
from urpe.files import CorruptFileError  # noqa: E402

QUIET = Execution(jobs=1, threads=1, progress=False)
CALLS: list[dict] = []


def square(config: dict, context: RunContext) -> RunResult:
    """A toy run: its record is a function of its config alone."""
    import torch

    CALLS.append(config)
    context.on_step(1)
    (context.run_dir / "log.txt").write_text("ran")
    return RunResult({"square": config["x"] ** 2}, {"x": torch.full((2,), float(config["x"]))})


def fails_on_three(config: dict, context: RunContext) -> RunResult:
    if config["x"] == 3:
        raise RuntimeError("three is not allowed\nsecond line")
    return square(config, context)


def dies_on_three(config: dict, context: RunContext) -> RunResult:
    import os
    import time

    if config["x"] == 3:
        # Mid-run, as a crash or an OOM kill: the worker's "start" event has left its queue.
        time.sleep(1.0)
        os._exit(3)  # the worker process itself ends
    return square(config, context)


def interrupted(config: dict, context: RunContext) -> RunResult:
    raise KeyboardInterrupt


def _specs(*xs):
    return [RunSpec(f"x{x}", {"x": x}) for x in xs]


def test_sweep_records_each_run_with_its_config_result_and_tensors(tmp_path):
    from safetensors.torch import load_file

    CALLS.clear()
    outcome = sweep(square, _specs(2, 3), tmp_path, QUIET, resume=False)
    assert outcome.trained == 2 and outcome.skipped == 0 and not outcome.failed
    assert CALLS == [{"x": 2}, {"x": 3}]
    store = RecordStore(tmp_path)
    for spec in _specs(2, 3):
        record = json.loads(store.record_path(spec).read_text())
        assert record["config"] == spec.config and record["id"] == spec.id
        assert record["result"] == {"square": spec.config["x"] ** 2}
        assert record["execution"]["jobs"] == 1 and "gpus" not in record["execution"]
        assert load_file(str(store.tensors_path(record)))["x"].tolist() == [spec.config["x"]] * 2
        assert (store.run_dir(spec) / "log.txt").read_text() == "ran"
    assert not [p for p in (tmp_path / "records").iterdir() if p.name.startswith(".")]


def test_resume_calls_run_one_only_for_missing_runs(tmp_path):
    sweep(square, _specs(2), tmp_path, QUIET, resume=False)
    CALLS.clear()
    outcome = sweep(square, _specs(2, 5), tmp_path, QUIET, resume=True)
    assert CALLS == [{"x": 5}] and outcome.skipped == 1 and outcome.trained == 1
    assert sorted(r["result"]["square"] for r in outcome.records) == [4, 25]


def test_without_resume_a_run_starts_in_a_clean_folder(tmp_path):
    (spec,) = _specs(2)
    stale = RecordStore(tmp_path).run_dir(spec) / "checkpoints" / "step-00000001"
    stale.mkdir(parents=True)
    sweep(square, [spec], tmp_path, QUIET, resume=False)
    assert not stale.exists()


def test_a_failed_run_is_booked_with_its_traceback_and_the_others_go_on(tmp_path):
    outcome = sweep(fails_on_three, _specs(2, 3, 4), tmp_path, QUIET, resume=False)
    assert [spec.name for spec, _ in outcome.failed] == ["x3"]
    assert outcome.failed[0][1] == "RuntimeError: three is not allowed"
    (failed,) = _specs(3)
    assert "Traceback" in (RecordStore(tmp_path).run_dir(failed) / "error.txt").read_text()
    assert sorted(r["result"]["square"] for r in outcome.records) == [4, 16]


@pytest.mark.slow
def test_a_dead_worker_fails_its_run_only(tmp_path):
    execution = Execution(jobs=2, threads=1, progress=False)
    outcome = sweep(dies_on_three, _specs(2, 3, 4), tmp_path, execution, resume=False)
    assert [(spec.name, message) for spec, message in outcome.failed] == [
        ("x3", "worker died (exit code 3)")
    ]
    assert sorted(r["result"]["square"] for r in outcome.records) == [4, 16]


def test_ctrl_c_in_a_run_stops_the_sweep(tmp_path):
    with pytest.raises(SweepInterrupted):
        sweep(interrupted, _specs(2), tmp_path, QUIET, resume=False)


def test_a_sweep_refuses_a_run_listed_twice(tmp_path):
    with pytest.raises(ValueError, match="lists a run twice: x2"):
        sweep(square, _specs(2, 2), tmp_path, QUIET, resume=False)
    assert not (tmp_path / "records").exists()


def test_a_record_whose_config_was_changed_is_not_taken_for_its_run(tmp_path):
    (spec,) = _specs(2)
    store = RecordStore(tmp_path)
    path = store.write(spec, RunResult({"square": 4}), {}, 1.0) and store.record_path(spec)
    assert store.load(spec)["result"] == {"square": 4}
    record = json.loads(path.read_text())
    record["config"]["x"] = 9
    path.write_text(json.dumps(record))
    with pytest.raises(CorruptFileError, match="does not match its name"):
        store.load(spec)
    path.write_text(json.dumps({"format": "urpe-record/1"}))
    warnings: list[str] = []
    assert store.load_all(warnings.append) == [] and str(path) in warnings[0]


def test_an_execution_makes_the_training_config_of_a_run():
    execution = Execution(
        accelerator="cpu",
        devices=2,
        num_nodes=3,
        strategy="ddp",
        accumulate_grad_batches=4,
        checkpoint_every=7,
    )
    config = execution.train_config(max_steps=50, precision="bf16-mixed", seed=5, val_every=10)
    assert (config.max_steps, config.precision, config.seed, config.val_every) == (
        50,
        "bf16-mixed",
        5,
        10,
    )
    assert (config.accelerator, config.devices, config.num_nodes, config.strategy) == (
        "cpu",
        2,
        3,
        "ddp",
    )
    assert config.accumulate_grad_batches == 4 and config.checkpoint_every == 7


def test_where_data_lies_is_stored_but_not_part_of_a_runs_identity(tmp_path):
    from urpe.experiments.records import LOCATIONS

    config = {"experiment": "x", "dataset": "text:sha256-0123456789ab"}
    here = RunSpec("my data/run", {**config, LOCATIONS: {"dataset": "/a/file.txt"}})
    moved = RunSpec("my data/run", {**config, LOCATIONS: {"dataset": "/b/file.txt"}})
    edited = RunSpec("my data/run", {**config, "dataset": "text:sha256-ffffffffffff"})
    assert here.id == moved.id != edited.id
    assert "/" not in here.id and here.id.startswith("my_data_run-")  # one file name
    store = RecordStore(tmp_path)
    store.write(here, RunResult({"loss": 1.0}), {}, 0.0)
    assert store.load(moved)["config"][LOCATIONS] == {"dataset": "/a/file.txt"}
