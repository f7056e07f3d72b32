"""The sweep's one progress bar: runs done / total in its description, time left from the update
rate, and one line per finished run above it (in a log: those lines, and a line per tenth of
the updates; see `urpe.progress`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..progress import progress_bar
from .records import RunSpec


class Progress:
    def __init__(self, specs: Sequence[RunSpec], enabled: bool):
        self.specs = specs
        self.done = 0
        self.steps = {i: 0 for i in range(len(specs))}
        self.bar = progress_bar(
            total=sum(s.steps for s in specs),
            enabled=enabled,
            unit="step",
            desc=self._description(),
            leave=True,
            mininterval=0.5,
            smoothing=0.05,
        )

    def _description(self) -> str:
        return f"runs {self.done}/{len(self.specs)}"

    def step(self, index: int, step: int) -> None:
        step = min(step, self.specs[index].steps)
        if step > self.steps[index]:
            self.bar.update(step - self.steps[index])
            self.steps[index] = step

    def finish(self, index: int, line: str) -> None:
        self.step(index, self.specs[index].steps)
        self.done += 1
        self.bar.set_description_str(self._description(), refresh=False)
        self.line(line)

    def line(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
