"""Sphinx extension: API reference pages that follow the packages' `__all__`, so that no list of
names is kept by hand.

    .. urpe-namespace::

is an autosummary table of every name `import urpe` offers, each linked to where the API
reference documents it (the subpackage that defines it, e.g. `urpe.attention` ->
`urpe.kernels.attention`).

    .. urpe-data:: urpe.kernels

documents the package's data in `__all__` (registries, constants, type aliases), which autodoc
leaves out when they are imported from a submodule: each with the comment that introduces it
in the source, and its keys (a registry) or its value (a small constant).

A dataclass's fields are documented once, as the parameters of its class (with their types, and
the descriptions of its docstring's Args: section): a field without a doc comment of its own
(`#:`) is not listed again as a bare attribute.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Mapping

from sphinx.util.docutils import SphinxDirective


def documented_name(name: str) -> str:
    """Where the reference documents `urpe.NAME`: the subpackage whose __all__ exports it."""
    import urpe

    source = urpe._SOURCES[name]
    if source.startswith("urpe.training."):  # re-exported by urpe.training, documented there
        source = "urpe.training"
    return f"{source}.{name}"


class NamespaceSummary(SphinxDirective):
    def run(self):
        import urpe

        lines = [".. autosummary::", "   :nosignatures:", ""]
        lines += [f"   ~{documented_name(name)}" for name in urpe.__all__]
        return self.parse_text_to_nodes("\n".join(lines))


def _is_data(value) -> bool:
    return not (inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value))


def _source_comment(package: str, name: str) -> str:
    """The `#` comment on the line that defines `name` in one of the package's modules, or in the
    lines right above it."""
    pattern = re.compile(rf"^{re.escape(name)}\s*(:[^=]*)?=")
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith(package) or module is None:
            continue
        try:
            lines = inspect.getsource(module).splitlines()
        except (OSError, TypeError):
            continue
        for i, line in enumerate(lines):
            if pattern.match(line):
                above = []
                for previous in reversed(lines[:i]):
                    if not previous.startswith("#"):
                        break
                    above.insert(0, previous.lstrip("# "))
                trailing = line.partition("  # ")[2] if "  # " in line else ""
                return " ".join([*above, trailing]).strip()
    return ""


def _summary(value) -> str:
    if isinstance(value, Mapping):
        return "Names: " + ", ".join(f"``{key}``" for key in value) + "." if value else "Empty."
    text = repr(value)
    return f"Value: ``{text}``." if len(text) <= 200 else ""


class PackageData(SphinxDirective):
    required_arguments = 1

    def run(self):
        package = self.arguments[0]
        module = importlib.import_module(package)
        lines = []
        for name in module.__all__:
            value = getattr(module, name)
            if not _is_data(value):
                continue
            lines += [f".. py:data:: {name}", f"   :module: {package}", ""]
            for text in (_source_comment(package, name), _summary(value)):
                if text:
                    lines += [f"   {text}", ""]
        return self.parse_text_to_nodes("\n".join(lines))


def _class_being_documented() -> type | None:
    """The class whose members autodoc is choosing: the `props` of its member filter, up the
    stack (the event does not name the parent). None where this autodoc has no such frame."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = getattr(frame.f_locals.get("props"), "_obj", None)
        if inspect.isclass(owner):
            return owner
        frame = frame.f_back
    return None


def skip_bare_field(app, what, name, obj, skip, options):
    import dataclasses

    from sphinx.pycode import ModuleAnalyzer

    cls = _class_being_documented() if what == "class" else None
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    if name not in {field.name for field in dataclasses.fields(cls)}:
        return None
    try:
        commented = (cls.__qualname__, name) in ModuleAnalyzer.for_module(
            cls.__module__
        ).find_attr_docs()
    except Exception:  # noqa: BLE001 - no source to read: keep autodoc's choice
        return None
    return True if not commented else None


def setup(app):
    app.add_directive("urpe-namespace", NamespaceSummary)
    app.add_directive("urpe-data", PackageData)
    app.connect("autodoc-skip-member", skip_bare_field)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
