"""Progress as tqdm's and pip's users expect it: an animated bar on a terminal; in a log or a pipe,
plain lines (a tenth of the work done, at most one line per interval, and one at the end), never
`\\r` frames; every progress display of urpe goes through the one helper."""

import io
import re
from pathlib import Path

import pytest

import urpe
from urpe.progress import ProgressLines, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_a_log_progress_is_plain_lines():
    log = io.StringIO()
    assert list(progress_bar(range(7), desc="predict", unit="batch", stream=log)) == list(range(7))
    assert re.fullmatch(r"predict: 7/7 batches \(100%\) in \d+\.\d s\n", log.getvalue())


def test_a_line_per_tenth_done_at_most_one_per_interval():
    log, clock = io.StringIO(), Clock()
    bar = ProgressLines(
        total=100, desc="runs 0/2", unit="step", stream=log, clock=clock, interval=10.0
    )
    for _ in range(100):
        clock.now += 1.0  # one second per step
        bar.update(1)
        if bar.n == 50:
            bar.set_description_str("runs 1/2")
            bar.write("run a: done")
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0] == "runs 0/2: 10/100 steps (10%) after 10 s, about 1 min 30 s left"
    assert lines[4] == "runs 0/2: 50/100 steps (50%) after 50 s, about 50 s left"
    assert lines[5] == "run a: done"
    assert lines[-1] == "runs 1/2: 100/100 steps (100%) in 1 min 40 s"
    assert len(lines) == 9 + 1 + 1  # tenths 1..9, the written line, the end


def test_fast_work_gets_one_line_and_work_without_a_total_counts():
    log, clock = io.StringIO(), Clock()
    with ProgressLines(total=1000, unit="line", stream=log, clock=clock) as bar:
        bar.update(1000)
    assert log.getvalue() == "1,000/1,000 lines (100%) in 0.0 s\n"
    log = io.StringIO()
    with ProgressLines(desc="read", unit="file", stream=log, clock=clock, interval=5) as bar:
        for _ in range(3):
            clock.now += 3
            bar.update()
    assert log.getvalue().splitlines() == ["read: 2 files after 6.0 s", "read: 3 files in 9.0 s"]


def test_on_a_terminal_it_is_tqdms_bar():
    from tqdm import tqdm

    screen = Terminal()
    bar = progress_bar(range(3), desc="predict", unit="batch", stream=screen)
    assert isinstance(bar, tqdm)
    list(bar)
    assert "\r" in screen.getvalue() and "predict" in screen.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_disabled_progress_says_nothing(stream):
    out = stream()
    assert list(progress_bar([1, 2], enabled=False, stream=out)) == [1, 2]
    assert out.getvalue() == ""


def test_no_module_draws_a_bar_of_its_own():
    """Only urpe/progress.py imports tqdm or asks a library for a bar of its own."""
    root = Path(urpe.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "progress.py" or path.parent != root
        if re.search(r"^\s*(from|import) tqdm|show_progress=progress[,)]", path.read_text(), re.M)
    ]
    assert offenders == []


def test_the_sweep_bar_in_a_log_is_lines(capsys):
    from urpe.experiments.progress import Progress
    from urpe.experiments.records import RunSpec

    progress = Progress([RunSpec("a", {}, steps=4), RunSpec("b", {}, steps=4)], enabled=True)
    for step in range(1, 5):
        progress.step(0, step)
    progress.finish(0, "a: accuracy 1.0")
    progress.finish(1, "b: accuracy 0.5")
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[:2] == ["a: accuracy 1.0", "b: accuracy 0.5"]
    assert err.splitlines()[-1].startswith("runs 2/2: 8/8 steps (100%) in ")
