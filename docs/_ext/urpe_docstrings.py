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

A dataclass's "Attributes:" section is read as its "Args:" (its fields are the parameters of its
class, listed once with their types, `urpe_api`), an entry naming several fields ("name, target,
unit: ...") as one entry per field with the same text.

After napoleon, a property's or attribute's first line "Nothing to compute: the output is empty"
is put back as written: napoleon reads the text before its first colon as the type ("TYPE:
Nothing to compute"), but urpe's types come from the annotations, never from the docstring.
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


def fields_as_args(lines: list[str]) -> list[str]:
    """An "Attributes:" section as "Args:", with an entry "a, b: text" (and the lines under it)
    written once per name."""
    out: list[str] = []
    header = None  # the section's indent while inside it
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.fullmatch(r"\s*Attributes:\s*", line):
            header = _indent(line)
            out.append(line.replace("Attributes:", "Args:"))
            i += 1
            continue
        if header is not None and line.strip() and _indent(line) <= header:
            header = None
        entry = re.match(r"(\s+)(\w+(?:, \w+)+):(\s.*)?$", line) if header is not None else None
        if entry is None:
            out.append(line)
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
            j += 1
        for field in entry.group(2).split(", "):
            out += [f"{entry.group(1)}{field}:{entry.group(3) or ''}", *lines[i + 1 : j]]
        i = j
    return out


def process_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    import dataclasses

    if what == "class" and dataclasses.is_dataclass(obj):
        lines[:] = fields_as_args(lines)
    lines[:] = normalize(lines)


def restore_inline_type(lines: list[str]) -> list[str]:
    """Napoleon's attribute docstring (the description, "", ":type: TEXT") with TEXT put back
    in front of the description, as the docstring has it."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(":type: "):
            prose = lines[i][len(":type: ") :]
            rest = lines[:i]
            while rest and not rest[-1].strip():
                rest.pop()
            first = next((k for k, line in enumerate(rest) if line.strip()), None)
            if first is None:
                return [prose, *lines[i + 1 :]]
            line = rest[first]
            rest[first] = f"{line[: len(line) - len(line.lstrip())]}{prose}: {line.lstrip()}"
            return [*rest, *lines[i + 1 :]]
    return lines


def process_attribute(app, what, name, obj, options, lines: list[str]) -> None:
    if what in ("attribute", "property", "data"):
        lines[:] = restore_inline_type(lines)


def setup(app):
    app.connect("autodoc-process-docstring", process_docstring, priority=100)  # before napoleon
    app.connect("autodoc-process-docstring", process_attribute, priority=900)  # after napoleon
    return {"parallel_read_safe": True, "parallel_write_safe": True}
