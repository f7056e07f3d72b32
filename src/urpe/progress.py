"""Progress that suits where it is shown, as tqdm's and pip's users expect: an animated bar (tqdm)
when stderr is a terminal; in a log file or a pipe, plain lines and never a `\\r` frame: one
when each further tenth of the work is done (at most one per `LINE_INTERVAL` seconds, so fast
work says nothing until it ends) and one when it ends.

    for batch in progress_bar(batches, desc="predict", unit="batch", enabled=show):
        ...

Every progress display in urpe goes through `progress_bar`. What it returns has the part of
tqdm's interface that urpe uses: iteration, `update`, `set_description_str`, `write`, `close`,
`n`, `disable`, and `with`. Standard library only: tqdm is imported when a bar is drawn.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

LINE_INTERVAL = 10.0  # seconds, at least, between two lines before the end


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether `stream` (default: stderr) is a terminal, where a bar can redraw itself."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    leave: bool = False,
    stream: IO[str] | None = None,
    **bar_options: Any,
) -> Any:
    """tqdm's bar on a terminal, `ProgressLines` elsewhere, silence when not `enabled`.
    `bar_options` go to tqdm only (mininterval, smoothing, ...)."""
    stream = sys.stderr if stream is None else stream
    if enabled and on_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(
            iterable,
            total=total,
            desc=desc,
            unit=unit,
            leave=leave,
            file=stream,
            dynamic_ncols=True,
            **bar_options,
        )
    return ProgressLines(
        iterable, total=total, desc=desc, unit=unit, enabled=enabled, stream=stream
    )


class ProgressLines:
    """Progress for a log: see the module docstring. `clock` and `interval` are for tests."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        enabled: bool = True,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LINE_INTERVAL,
    ):
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.disable = not enabled
        self.stream = stream
        self.clock, self.interval = clock, interval
        self.n = 0
        self.start = self.last_line = clock()
        self.tenths_said = 0
        self.closed = False

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("this progress has no iterable; call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.disable or self.closed:
            return
        now = self.clock()
        if now - self.last_line < self.interval:
            return
        if self.total:
            tenths = min(10, self.n * 10 // self.total)
            if tenths <= self.tenths_said or tenths == 10:  # the end has a line of its own
                return
            self.tenths_said = tenths
        self.last_line = now
        self.write(self._line(now, finished=False))

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def write(self, text: str, file: IO[str] | None = None) -> None:
        print(text, file=file or self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.disable and (self.n or self.total):
            self.write(self._line(self.clock(), finished=True))

    def _line(self, now: float, finished: bool) -> str:
        elapsed = now - self.start
        units = self.unit if self.total == 1 or self.unit == "it" else _plural(self.unit)
        done = f"{self.n:,} {units}"
        if self.total:
            done = f"{self.n:,}/{self.total:,} {units} ({100 * self.n // self.total}%)"
        line = f"{self.desc}: {done}" if self.desc else done
        if finished:
            return f"{line} in {_duration(elapsed)}"
        line += f" after {_duration(elapsed)}"
        if self.total and self.n:
            line += f", about {_duration(elapsed * (self.total - self.n) / self.n)} left"
        return line


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s" if seconds else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
