"""The Python examples of the README and of the documentation (docs/**/*.md) run as written, and
each checks its own result."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), index, code)
    for page in PAGES
    if "_build" not in page.parts
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]
IDS = [f"{page}[{index}]" for page, index, _ in BLOCKS]


def test_the_pages_with_examples_are_found():
    pages = {page for page, _, _ in BLOCKS}
    assert pages >= {
        "README.md",
        "docs/getting-started.md",
        "docs/guides/attention.md",
        "docs/guides/models.md",
        "docs/guides/huggingface.md",
    }, pages


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=IDS)
def test_example_checks_its_result(page, index, code):
    """An example that asserts nothing would pass whatever it computed."""
    tree = ast.parse(code)
    assert any(isinstance(node, ast.Assert) for node in ast.walk(tree)), (
        f"{page} python block {index} asserts nothing:\n{code[:200]}"
    )


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=IDS)
def test_example_runs(page, index, code):
    exec(compile(code, f"{page}[python block {index}]", "exec"), {})
