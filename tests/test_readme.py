"""The README's Python examples run as written."""

import ast
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_checks_its_result(index):
    """An example that asserts nothing would pass whatever it computed."""
    tree = ast.parse(BLOCKS[index])
    assert any(isinstance(node, ast.Assert) for node in ast.walk(tree)), (
        f"README python block {index} asserts nothing:\n{BLOCKS[index][:200]}"
    )


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
