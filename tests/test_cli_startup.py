"""`urpe --help`, `urpe --version` and every `urpe COMMAND --help` start without importing torch
or any other heavy library: the command's own modules load only when it runs. Checked by the
modules a fresh interpreter holds afterwards, not by timing."""

import json
import subprocess
import sys

import pytest

from urpe.cli import COMMAND_MODES, COMMANDS, GROUP_HELP, SINGLE_COMMANDS
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
    *([name, mode, "--help"] for name, mode in COMMAND_MODES),
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


@pytest.mark.slow
def test_predict_and_evaluate_import_neither_pyg_nor_lightning(molecule_model, tmp_path):
    """A trained graph model's `predict` and `evaluate` never import PyTorch Geometric or
    Lightning (most of their start-up before), and predict what the PyG route predicts."""
    import csv

    from torch_geometric.data import Batch

    import urpe

    smiles = ["CCO", "c1ccccc1O", "C1CC", "CC(=O)[O-].[Na+]", "C#N"]
    table = tmp_path / "molecules.csv"
    table.write_text("smiles,heavy\n" + "".join(f"{s},{i + 2}\n" for i, s in enumerate(smiles)))
    heavy, stdout = _heavy_after(["predict", str(molecule_model), str(table), "--no-progress"])
    assert not {"torch_geometric", "lightning", "pytorch_lightning"} & set(heavy), heavy
    rows = list(csv.DictReader(stdout.splitlines()))
    assert [r["smiles"] for r in rows] == smiles and rows[2]["predicted_heavy"] == ""

    model = urpe.load_model(molecule_model)
    graphs = [g for g in model.graphs(smiles) if g is not None]  # PyG's Data, PyG's Batch
    expected = model.model(Batch.from_data_list(graphs)).tolist()
    got = [float(r["predicted_heavy"]) for r in rows if r["predicted_heavy"]]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)

    heavy, stdout = _heavy_after(["evaluate", str(molecule_model), str(table), "--json"])
    assert not {"torch_geometric", "lightning", "pytorch_lightning"} & set(heavy), heavy
    truths = [2, 3, 5, 6]  # the readable rows' values
    mae = sum(abs(p - t) for p, t in zip(expected, truths, strict=True)) / len(truths)
    assert json.loads(stdout)["mae"] == pytest.approx(mae, rel=1e-5)


# What a graph model's predictions and evaluation do without (PyG and Lightning: the test above):
# SciPy (shortest paths of molecules are searched by numpy) and the language models' stack.
NOT_FOR_MOLECULES = ("scipy", "urpe.models", "urpe.distributed", "urpe.data.molecules.datasets")


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_predict_and_evaluate_import_neither_scipy_nor_language_models(
    command, molecule_model, tmp_path
):
    """Checked by the modules the command's interpreter holds once it has predicted."""
    table = tmp_path / "molecules.csv"
    table.write_text("smiles,heavy\nCCO,3\nc1ccccc1O,7\nC1CC,1\n")
    script = (
        "import contextlib, io, json, sys\n"
        "from urpe.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main({[command, str(molecule_model), str(table), '--no-progress']!r})\n"
        f"loaded = [m for m in {NOT_FOR_MOLECULES!r} if m in sys.modules]\n"
        "print(json.dumps([status, loaded, 'torch' in sys.modules, 'rdkit' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    status, loaded, torch_loaded, rdkit_loaded = json.loads(done.stdout)
    assert status == 0 and torch_loaded and rdkit_loaded  # it did predict
    assert loaded == [], f"urpe {command} imported {loaded}"


def _stderr_on_terminal(script: str) -> tuple[int, list[str]]:
    """Run `script` with stderr on a pseudo-terminal: its exit status and the lines it wrote."""
    import os
    import pty

    terminal, attached = pty.openpty()  # stderr a terminal
    process = subprocess.Popen([sys.executable, "-c", script], stderr=attached)
    os.close(attached)  # the child holds it; read until it closes
    said = b""
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        said += chunk
    os.close(terminal)
    return process.wait(timeout=120), said.decode().splitlines()


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_predict_and_evaluate_say_a_line_before_importing_torch(command, molecule_model):
    """On a terminal, `urpe predict` and `urpe evaluate` say at once that they load the model,
    before PyTorch is imported (here torch cannot be imported at all); in a pipe they do not."""
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # importing torch fails\n"
        "from urpe.cli import main\n"
        f"main({[command, str(molecule_model), 'CCO']!r})\n"
    )
    status, lines = _stderr_on_terminal(script)
    assert status != 0 and "torch" in lines[-1]  # it stopped at torch
    assert lines[0] == f"urpe {command}: loading {molecule_model} (importing PyTorch)"
    piped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "loading" not in piped.stderr and "torch" in piped.stderr


TRAINING = sorted({name for group, name in COMMANDS if group == "reproduce"} | {"finetune"})


@pytest.mark.parametrize("name", TRAINING)
def test_training_commands_say_a_line_before_importing_torch(name, tmp_path):
    """On a terminal, the first line of a training command comes before PyTorch is imported
    (seconds of silence before): here torch cannot be imported at all, and the line is there
    anyway. In a log or a pipe the output is as before (a bad flag: one line)."""
    argv = ["finetune"] if name == "finetune" else ["reproduce", name]
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # importing torch fails\n"
        "from urpe.cli import main\n"
        f"main({argv + ['--out', str(tmp_path / 'out')]!r})\n"
    )
    prog = " ".join(["urpe", *argv])
    status, lines = _stderr_on_terminal(script)
    assert status != 0 and "torch" in "\n".join(lines)  # it stopped at torch
    assert lines[0] == f"{prog}: starting (loading PyTorch and Lightning)"
    piped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "starting" not in piped.stderr and "torch" in piped.stderr


def test_loading_pauses_the_collector_and_freezes_what_it_loaded():
    """`urpe.startup.loading`: no collections inside, what it made frozen after, the collector
    as it was (off stays off); `thaw` (the end of `urpe.cli.main`) unfreezes."""
    import gc

    from urpe.startup import loading, thaw

    assert gc.isenabled()
    try:
        with loading():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # tracked objects
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        thaw()
        assert gc.get_freeze_count() == 0
        gc.disable()
        with loading():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        thaw()
