"""benchmarks/count_instructions.py: what it refuses and says without valgrind (counting itself
runs minutes under valgrind: `python benchmarks/count_instructions.py`, BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "count_instructions.py"


def _script():
    spec = importlib.util.spec_from_file_location("count_instructions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_names_every_model_and_the_commands():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for name in ("base", "gate", "fox", "fox-python", "--new-tokens", "--prompt 2048"):
        assert name in done.stdout


@pytest.mark.parametrize("argument", [["--new-tokens", "0"], ["--batch", "-1"], ["--models", "x"]])
def test_bad_arguments_are_refused_in_one_line(argument):
    done = subprocess.run([sys.executable, str(SCRIPT), *argument], capture_output=True, text=True)
    assert done.returncode == 2 and "error:" in done.stderr.splitlines()[-1]


def test_without_valgrind_it_says_what_it_needs(monkeypatch, capsys):
    script = _script()
    monkeypatch.setattr(script.shutil, "which", lambda name: None)
    assert script.main(["--models", "base"]) == 2
    assert "valgrind and callgrind_control" in capsys.readouterr().out
