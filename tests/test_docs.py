"""The documentation builds as `make docs` builds it (every warning an error, every reference
resolved, nothing fetched), and its references cover what the code offers: every public name of
the documented packages, and every command of the `urpe` command line."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="the docs extra: pip install 'urpe[docs]'")

ROOT = Path(__file__).resolve().parents[1]
# The packages of the API reference whose __all__ it must cover (docs/api/*.rst).
DOCUMENTED = [
    "urpe.kernels",
    "urpe.encodings",
    "urpe.nn",
    "urpe.distributed",
    "urpe.models",
    "urpe.hf",
    "urpe.graph",
    "urpe.data.text",
    "urpe.data.molecules",
    "urpe.tasks",
    "urpe.training",
]


def make_docs_command() -> list[str]:
    """The sphinx arguments of `make docs` (its recipe in the Makefile), paths as there."""
    import shlex

    recipe = ROOT.joinpath("Makefile").read_text().split("\ndocs:", 1)[1].splitlines()[1]
    words = shlex.split(recipe.strip())
    return words[words.index("sphinx") + 1 :]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The site built with `make docs`'s arguments, its output folders moved into a tmp dir."""
    out = tmp_path_factory.mktemp("docs")
    arguments = [
        str(out / Path(a).relative_to("docs/_build")) if a.startswith("docs/_build") else a
        for a in make_docs_command()
    ]
    arguments = [str(ROOT / "docs") if a == "docs" else a for a in arguments]
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", *arguments],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return out / "html"


def _inventory(built: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with open(built / "objects.inv", "rb") as handle:
        inventory = InventoryFile.load(handle, "", lambda base, uri: uri)
    return {name for kind, names in inventory.items() if kind.startswith("py:") for name in names}


def test_the_api_reference_documents_every_public_name(built):
    import importlib

    import urpe

    documented = _inventory(built)
    missing = [
        f"{package}.{name}"
        for package in DOCUMENTED
        for name in importlib.import_module(package).__all__
        if f"{package}.{name}" not in documented
    ]
    assert missing == []
    namespace = (built / "api" / "urpe.html").read_text()
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from urpe_api import documented_name
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    for name in urpe.__all__:  # each `urpe.NAME` links to where it is documented
        assert documented_name(name) in documented, name
        assert f'#{documented_name(name)}"' in namespace, name


def test_the_cli_reference_has_every_command_and_its_help(built):
    from urpe.cli import COMMANDS, SINGLE_COMMANDS

    page = (built / "cli.html").read_text()
    for group, name in COMMANDS:
        assert f'id="urpe-{group}-{name}"' in page
    for name in SINGLE_COMMANDS:
        assert f'id="urpe-{name}"' in page
    assert "--accumulate-grad-batches" in page and "usage: urpe finetune" in page


def test_the_guides_are_all_in_the_site(built):
    guides = sorted(p.stem for p in (ROOT / "docs" / "guides").glob("*.md"))
    assert guides == sorted(p.stem for p in (built / "guides").glob("*.html"))
    assert (built / "porting.html").exists() and (built / "getting-started.html").exists()


def test_the_site_holds_no_doctrees(built):
    """Sphinx's pickled doctrees go beside the site (`-d`), not into what is published."""
    assert make_docs_command()[-1] == "docs/_build/html"
    assert not (built / ".doctrees").exists() and (built.parent / "doctrees").is_dir()


def test_long_help_lines_wrap_instead_of_being_cut(built):
    page = (built / "cli.html").read_text()
    assert page.count('class="urpe-help') >= 10  # every command's --help block
    assert "white-space: pre-wrap" in (built / "_static" / "urpe.css").read_text()
    assert 'href="_static/urpe.css' in page


def _text(built: Path, page: str, anchor: str, length: int = 3000) -> str:
    """The words of `page` from the element with id `anchor` on, tags removed."""
    import html
    import re

    source = (built / page).read_text()
    start = source.index(f'id="{anchor}"')
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", source[start : start + length])).split())


def test_a_propertys_first_line_is_not_read_as_its_type(built):
    """Napoleon read "Nothing to compute: the output ..." as type "Nothing to compute": a
    property's docstring, colons and all, is its text."""
    from urpe.kernels import AttentionSpec

    text = _text(built, "api/kernels.html", "urpe.kernels.AttentionSpec.is_empty", 1500)
    first = " ".join(AttentionSpec.is_empty.__doc__.split())
    assert ":" in first and first in " ".join(text.split())


def test_a_dataclass_lists_its_fields_once(built):
    """A dataclass's fields are its parameters (with their types); they were listed a second
    time as bare attributes."""
    page = (built / "api" / "kernels.html").read_text()
    assert 'id="urpe.kernels.AttentionSpec.q"' not in page
    assert 'id="urpe.kernels.AttentionSpec.is_empty"' in page  # its properties stay
    assert "q ( Tensor )" in _text(built, "api/kernels.html", "urpe.kernels.AttentionSpec", 20000)


def test_every_documented_class_and_function_has_a_docstring():
    """TransformerXLRelative, FeedForward and get_task had none (the reference showed the bare
    signature)."""
    import importlib
    import inspect

    missing = [
        f"{package}.{name}"
        for package in DOCUMENTED
        for name, value in vars(importlib.import_module(package)).items()
        if name in importlib.import_module(package).__all__
        and (inspect.isclass(value) or inspect.isfunction(value))
        and not (value.__doc__ or "").strip()
    ]
    assert missing == []
