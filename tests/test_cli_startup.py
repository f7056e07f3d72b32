"""`urpe --help`, `urpe --version` and every `urpe COMMAND --help` start without importing torch
or any other heavy library: the command's own modules load only when it runs. Checked by the
modules a fresh interpreter holds afterwards, not by timing."""

import json
import subprocess
import sys

import pytest

from urpe.cli import COMMANDS, GROUP_HELP, SINGLE_COMMANDS
from urpe.experiments.model_choices import BUILT_IN, REGISTERED

HEAVY = (
    "torch",
    "numpy",
    "scipy",
    "transformers",
    "tokenizers",
    "safetensors",
    "peft",
    "lightning",
    "pytorch_lightning",
    "torchmetrics",
    "tensorboard",
    "matplotlib",
    "tqdm",
    "rdkit",
    "torch_geometric",
    "triton",
    "x_transformers",
)

HELP_LINES = [
    ["--help"],
    ["--version"],
    *([group, "--help"] for group in GROUP_HELP),
    *([name, "--help"] for name in SINGLE_COMMANDS),
    *([group, name, "--help"] for group, name in COMMANDS),
]


def _heavy_after(argv: list[str]) -> tuple[list[str], str]:
    """Run `urpe ARGV` in a fresh interpreter: the heavy modules it imported, and its stdout."""
    script = (
        "import contextlib, io, json, sys\n"
        "from urpe.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code in (0, None), exit.code\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(json.dumps([heavy, out.getvalue()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    heavy, stdout = json.loads(done.stdout)
    return heavy, stdout


@pytest.mark.parametrize("argv", HELP_LINES, ids=" ".join)
def test_help_and_version_import_no_heavy_module(argv):
    heavy, stdout = _heavy_after(argv)
    assert heavy == [], f"urpe {' '.join(argv)} imported {heavy}"
    assert stdout.strip()


def test_import_urpe_needs_no_torch_until_a_name_is_used():
    script = (
        "import sys, urpe\n"
        "assert 'torch' not in sys.modules\n"
        "assert urpe.attention is __import__('urpe.kernels').kernels.attention\n"
        "assert urpe.models.TransformerConfig is urpe.TransformerConfig\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_every_public_name_is_the_defining_modules_object():
    import importlib

    import urpe

    for name in urpe.__all__:
        source = importlib.import_module(urpe._SOURCES[name])
        assert getattr(urpe, name) is getattr(source, name), name
    assert set(urpe.__all__) == set(urpe._SOURCES) and set(urpe.__all__) <= set(dir(urpe))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        urpe.nonexistent  # noqa: B018


def test_help_offers_the_built_in_names_without_the_registries():
    heavy, stdout = _heavy_after(["reproduce", "synthetic", "--help"])
    text = "".join(stdout.split())
    assert heavy == []
    for flag, (_, names) in BUILT_IN.items():
        assert f"--{flag}{{{','.join(names)}}}" in text, flag


@pytest.mark.parametrize("flag", sorted(BUILT_IN))
def test_the_built_in_names_are_what_the_registries_hold(flag):
    """The lists `--help` shows without torch are the registries' own (nothing else registered)."""
    module, names = BUILT_IN[flag]
    assert REGISTERED[flag]() == list(names)
    assert module in sys.modules  # the registry lives where the lazy choice looks for it


def test_the_synthetic_task_names_are_the_tasks():
    from urpe.experiments.synthetic.presets import TASKS
    from urpe.tasks import TASKS as REAL

    assert TASKS == tuple(REAL)


def test_bench_help_offers_the_built_in_rows():
    """`urpe bench attention --help` lists urpe's own rows without importing torch; they are
    what the registry makes."""
    from urpe.bench import rows
    from urpe.kernels import BACKENDS

    heavy, stdout = _heavy_after(["bench", "attention", "--help"])
    assert heavy == [] and "cpp_urpe" in stdout and "triton_urpe" in stdout
    for device, names in rows.BUILT_IN_BACKENDS.items():
        assert list(names) == [
            n for n, b in BACKENDS.items() if b.devices is None or device in b.devices
        ]
        built_in = rows.rows_for_backends(device, names)
        registry = rows.rows_for(device)  # the backends available here: a subset
        assert [name for name in built_in if name in registry] == list(registry)
