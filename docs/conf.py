"""Sphinx configuration of urpe's documentation (`make docs`; tests/test_docs.py builds it too).

Pages are Markdown (MyST) except the API reference, which is reStructuredText around autodoc.
Nothing is fetched: no intersphinx, no remote images; references to other libraries' objects
(torch, transformers, ...) are left as plain text instead of links.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent / "src"), str(DOCS / "_ext")]

import urpe  # noqa: E402

project = "urpe"
author = "The urpe contributors"
copyright = "the urpe contributors"
release = version = urpe.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "urpe_api",
    "urpe_cli",
    "urpe_docstrings",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

html_theme = "furo"
html_title = f"urpe {release}"
html_static_path = ["_static"]
html_css_files = ["urpe.css"]  # long lines of the command-line reference wrap

# In the docstrings, `name` is code, as in Markdown and in the guides; quotes stay straight.
default_role = "code"
smartquotes = False

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# The API reference: every name in each package's __all__, with Google-style Args sections.
# Undocumented names too (registries, constants): the reference covers all of __all__; values
# are left out (a registry's repr is long and says less than its docstring).
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "show-inheritance": True,
    "no-value": True,
}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # Lightning's hooks' docstrings are Lightning's to document
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes: sections as fields; the attributes get their own entries (a dataclass's section is
# read as its Args:, its fields listed once as parameters: _ext/urpe_docstrings.py, urpe_api.py)
napoleon_use_ivar = True

# Every reference must resolve (-n), except to what these pages do not document: other
# libraries' objects, with no intersphinx (the build reads no network), private helpers, and
# shape symbols.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|nn|transformers|lightning|pytorch_lightning|torchmetrics|torch_geometric|"
        r"rdkit|Chem|numpy|np|scipy|safetensors|tokenizers|peft|matplotlib|triton|"
        r"collections|pathlib|os|abc|typing|argparse)(\..*)?",
    ),
    (r"py:.*", r"Tensor|Module|Dataset|Sampler|Data|Path|Generator|long"),
    (r"py:.*", r"urpe\.nn\.past\.ProjectsKeys|StepStream"),  # protocols of private helpers
    (r"py:.*", r"(.*\.)?_\w+|.*\.T|[A-Z]"),  # private names, type variables, shape symbols
    (r"py:.*", r".*[\s'\[].*"),  # prose and unparsed annotations, not names
]
