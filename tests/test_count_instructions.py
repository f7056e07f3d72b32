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
    names = ("base", "gate", "fox", "fox-python", "--new-tokens", "--prompt 2048", "--compiled")
    names += ("--keep-dumps",)
    for name in names:
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


def test_compiled_counts_transformers_fast_path():
    """--compiled: a static cache and inductor, also on the CPU (transformers compiles only on
    GPUs unless told to)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    _script()._static_compiled(llama)
    generation = llama.generation_config
    assert generation.cache_implementation == "static"
    assert generation.compile_config.backend == "inductor"
    assert generation.compile_config._compile_all_devices
