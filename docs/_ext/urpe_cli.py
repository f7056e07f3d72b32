"""Sphinx extension: the command-line reference, generated from urpe's own argparse parsers.

    ```{urpe-cli}
    ```

becomes one section per command (`urpe`, each group, each command, then the `python -m` tools),
each with the command's one-line help and the exact text its `--help` prints, produced at build
time by running the command's parser. Nothing is copied by hand, so the page cannot drift from
the code.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

# Tools run as `python -m MODULE`: the module whose `main(argv)` parses their arguments, and what
# they are for.
MODULE_TOOLS = {
    "python -m urpe.kernels.cpp": (
        "urpe.kernels.cpp.build",
        "Build the C++ CPU kernel now, showing the compiler's errors.",
    ),
    "python -m urpe.experiments.synthetic.inspect": (
        "urpe.experiments.synthetic.inspect",
        "What a trained synthetic model attends to and where it keeps position; or its runs' "
        "learning curves.",
    ),
    "python -m urpe.experiments.lm.speed": (
        "urpe.experiments.lm.speed",
        "Step time of each URPE variant against its base, side by side in one process.",
    ),
}
WIDTH = "88"  # argparse wraps the help text to $COLUMNS; the page shows 88 columns


def _help(main, argv: list[str]) -> str:
    """What `main(argv + ["--help"])` prints (argparse exits after printing it)."""
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    text = out.getvalue()
    if not text.strip():
        raise RuntimeError(f"{' '.join(argv) or 'urpe'} --help printed nothing")
    return text


def commands() -> list[tuple[str, str, str]]:
    """(title, one-line summary, --help text) of every command, in the order of `urpe --help`."""
    from urpe.cli import COMMAND_MODES, COMMANDS, GROUP_HELP, SINGLE_COMMANDS, main

    entries = [("urpe", "The command; python -m urpe is the same.", [])]
    for group, summary in GROUP_HELP.items():
        entries.append((f"urpe {group}", summary, [group]))
        entries += [
            (f"urpe {group} {name}", help_text, [group, name])
            for (g, name), (_, help_text) in COMMANDS.items()
            if g == group
        ]
    entries += [
        (f"urpe {name}", help_text, [name]) for name, (_, help_text) in SINGLE_COMMANDS.items()
    ]
    entries += [
        (f"urpe {name} {mode}", help_text, [name, mode])
        for (name, mode), (_, help_text) in COMMAND_MODES.items()
    ]
    out = [(title, summary, _help(main, argv)) for title, summary, argv in entries]
    for title, (module, summary) in MODULE_TOOLS.items():
        out.append((title, summary, _help(importlib.import_module(module).main, [])))
    return out


class CommandLineReference(SphinxDirective):
    """One section per command: its summary and its `--help`."""

    def run(self) -> list[nodes.Node]:
        sections = []
        for title, summary, text in commands():
            name = nodes.fully_normalize_name(title)
            section = nodes.section(ids=[nodes.make_id(title)], names=[name])
            section += nodes.title(text=title)
            section += nodes.paragraph(text=summary)
            # urpe-help: wrapped, not cut, where a line is wider than the page (_static/urpe.css)
            section += nodes.literal_block(text, text, language="text", classes=["urpe-help"])
            self.state.document.note_implicit_target(section)
            sections.append(section)
        return sections


def setup(app):
    app.add_directive("urpe-cli", CommandLineReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
