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
    "urpe.models",
    "urpe.hf",
    "urpe.graph",
    "urpe.data.text",
    "urpe.data.molecules",
    "urpe.tasks",
    "urpe.training",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-n",
            "-E",
            "-q",
            "-b",
            "html",
            str(ROOT / "docs"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return out


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
