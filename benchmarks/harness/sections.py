"""Sections of BENCHMARKS.md that commands other than the CPU report write, each between its
own markers: the GPU section (`bench_attention.py --gpu-report`), the model section (the model
benchmark) and the context-parallel section (`bench_context_parallel.py --report`). Writing one
replaces it and keeps the rest of the file; the CPU report, which rewrites the file, carries
every section over."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """A part of a Markdown file between two HTML comments, written by `writer`."""

    name: str
    writer: str

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin (written by {self.writer}) -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def find(self, text: str) -> str | None:
        """The section in `text`, markers included (None: not there)."""
        if self.begin not in text or self.end not in text:
            return None
        return self.begin + text.split(self.begin, 1)[1].split(self.end, 1)[0] + self.end

    def write(self, path: Path, section: str) -> None:
        """Put `section` (markers included) into the file at `path`, replacing an earlier one
        and keeping everything else; appended at the end when the file has none."""
        text = path.read_text() if path.exists() else ""
        if self.find(text) is not None:
            head, rest = text.split(self.begin, 1)
            text = head + section.rstrip("\n") + rest.split(self.end, 1)[1]
        else:
            text = text.rstrip("\n") + ("\n\n" if text else "") + section
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


GPU = Section("gpu-section", "benchmarks/bench_attention.py --gpu-report")
MODEL = Section("model-section", "benchmarks/bench_model.py")
CONTEXT_PARALLEL = Section("context-parallel-section", "benchmarks/bench_context_parallel.py")
# issue 42's decoding figures, copied from `bench_issue42.py`'s output (it writes no file)
LONG_CACHE = Section("long-cache-section", "hand, from benchmarks/bench_issue42.py's output")
SECTIONS = (GPU, MODEL, CONTEXT_PARALLEL, LONG_CACHE)  # the order they follow the CPU report in


def keep_sections(path: Path, new_text: str) -> str:
    """`new_text` (a freshly written CPU report) with every section of the file at `path`
    carried over, so that a CPU run erases neither GPU figures nor the model section."""
    old = path.read_text() if path.exists() else ""
    kept = [s for s in (section.find(old) for section in SECTIONS) if s is not None]
    return "".join([new_text.rstrip("\n") + "\n"] + [f"\n{s}\n" for s in kept])
