"""Sphinx extension: urpe's docstrings read as written.

urpe's docstrings are plain text with Markdown's habits, which reStructuredText reads otherwise.
Before napoleon turns the Google-style sections (Args:, Returns:, ...) into fields, this:

- escapes | and * outside code spans: |j - i| is an absolute value and a * b a product, not a
  substitution or emphasis (`name` is code: the `code` default role in conf.py), and lets a
  code span touch a word ("`GraphSplit`s");
- makes an indented block that follows a blank line or a line ending in ":" a literal block
  (the code examples of module docstrings, aligned formulas);
- reads "name: text" with its continuation lines indented under it (a hanging indent) as one
  paragraph, as the source shows it, instead of an unfinished definition list.

Lines inside the Google-style sections are left to napoleon.
"""

from __future__ import annotations

import re

_CODE = re.compile(r"(``.*?``|`[^`]*`)")  # code spans, kept as they are
_SECTION = re.compile(
    r"\s*(Args|Arguments|Parameters|Keyword Args|Other Parameters|Returns?|Yields?|Raises|"
    r"Attributes|Examples?|Notes?|Warnings?|See Also|Methods|Todo):\s*$"
)
_BULLET = re.compile(r"([-*+]|\d+\.) ")


def _escape(line: str) -> str:
    parts = _CODE.split(line)
    for i in range(0, len(parts), 2):  # the text between code spans
        text = parts[i].replace("\\", "\\\\").replace("|", r"\|").replace("*", r"\*")
        # A code span touching a word ("`GraphSplit`s") needs an escaped space to end.
        if i > 0 and text[:1].isalnum():
            text = "\\ " + text
        if i + 1 < len(parts) and text[-1:].isalnum():
            text += "\\ "
        parts[i] = text
    return "".join(parts)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _content_indent(line: str) -> int:
    """Where the text of `line` starts: after its bullet, if it is a list item."""
    stripped = line.lstrip()
    bullet = _BULLET.match(stripped)
    return _indent(line) + (bullet.end() if bullet else 0)


def _in_sections(lines: list[str]) -> list[bool]:
    """Which lines belong to a Google-style section (its header, and what is indented under it
    or blank until the text comes back to the header's indent)."""
    inside, header = [], None
    for line in lines:
        if _SECTION.fullmatch(line):
            header = _indent(line)
        elif header is not None and line.strip() and _indent(line) <= header:
            header = None
        inside.append(header is not None)
    return inside


def normalize(lines: list[str]) -> list[str]:
    """`lines` as reStructuredText (see the module's docstring)."""
    sections = _in_sections(lines)
    out: list[str] = []
    literal: set[int] = set()  # indices in `out` of literal lines, which are not escaped
    text = None  # the last line of text outside the sections (None: none yet, or a section)
    i = 0
    while i < len(lines):
        line = lines[i]
        if sections[i] or not line.strip():
            out.append(line if sections[i] else "")
            text = None if sections[i] else text
            i += 1
            continue
        if text is not None and not out[-1].strip() and _indent(line) > _content_indent(text):
            # An indented block after a blank line is code, as in Markdown: a literal block.
            j = i
            while (
                j < len(lines)
                and not sections[j]
                and (not lines[j].strip() or _indent(lines[j]) > _content_indent(text))
            ):
                j += 1
            out += ["::", ""]
            literal.update(range(len(out), len(out) + j - i))
            out += [*lines[i:j], ""]
            i = j
            continue
        j = i + 1
        while (
            j < len(lines)
            and not sections[j]
            and lines[j].strip()
            and _indent(lines[j]) > _content_indent(line)
        ):
            j += 1
        run = lines[i + 1 : j]
        if not run:
            out.append(line)
        elif line.rstrip().endswith(":"):  # a block its line introduces: literal
            marker = "" if line.rstrip().endswith("::") else ":"
            out += [line.rstrip() + marker, ""]
            literal.update(range(len(out), len(out) + len(run)))
            out += [*run, ""]
        else:  # continuation lines under a hanging indent: one paragraph
            if out and out[-1].strip() and not sections[i - 1]:
                out.append("")
            out += [line, *(" " * _indent(line) + r.strip() for r in run), ""]
        text = line
        i = j
    return [line if k in literal else _escape(line) for k, line in enumerate(out)]


def process_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    lines[:] = normalize(lines)


def setup(app):
    app.connect("autodoc-process-docstring", process_docstring, priority=100)  # before napoleon
    return {"parallel_read_safe": True, "parallel_write_safe": True}
