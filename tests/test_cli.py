"""The `urpe` command as a user meets it: every bad argument is one line naming it, exit status
2, no traceback, nothing created; --version; python -m urpe; a missing extra names its fix."""

import subprocess
import sys

import pytest
import torch

import urpe
from urpe.cli import main


def _fails(argv, capsys):
    """Exit status and stderr of main(argv), whether argparse or the command refused it."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


BAD = [
    (["--seeds", "-1"], "argument --seeds: seeds must lie in [0, 2^32), got -1"),
    (["--seeds", "0,1,0"], "argument --seeds: 0 given more than once"),
    (["--variants", "urpe,rpe,urpe"], "argument --variants: urpe given more than once"),
    (["--tasks", "pi,pi"], "argument --tasks: pi given more than once"),
    (["--vocab-size", "10,10"], "argument --vocab-size: 10 given more than once"),
    (["--vocab-size", "10,0"], "argument --vocab-size: must be positive integers, got 0"),
    (["--tasks", "pi,nonsense"], "argument --tasks: unknown task nonsense"),
    (["--variants", "urpe,bogus"], "argument --variants: unknown variant bogus"),
    (["--precision", "foo"], "argument --precision: unknown precision 'foo'"),
    (["--precision", "16-mixed", "--accelerator", "cpu"], "argument --precision: 16-mixed needs"),
    (["--seq-len", "1"], "argument --seq-len: pi, etp, probe need a length >= 2, got 1"),
    (["--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
    (["--tasks", "etp", "--vocab-size", "1"], "argument --vocab-size: etp needs a vocabulary"),
    (["--dim", "30", "--heads", "4"], "argument --dim: 30 is not divisible by --heads 4"),
    (["--steps", "10", "--warmup", "20"], "argument --warmup: 20 exceeds --steps 10"),
    (["--steps", "-3"], "argument --steps: must be a positive integer, got -3"),
    (["--lr", "x"], "argument --lr: expected a number, got 'x'"),
    (["--accelerator", "tpu"], "argument --accelerator: invalid choice: 'tpu'"),
    (["--strategy", "fsdp", "--accelerator", "cpu"], "argument --strategy: fsdp needs GPUs"),
    (["--devices", "0"], "argument --devices: must be positive, got 0"),
    (["--devices", "two"], "argument --devices: expected auto, a positive count"),
    (["--devices", "3", "--accelerator", "cpu"], "argument --batch-size: 64 sequences per update"),
    (["--devices", "2", "--jobs", "2", "--accelerator", "cpu"], "argument --jobs: a run on"),
    (["--accumulate-grad-batches", "0"], "argument --accumulate-grad-batches: must be a positive"),
    (["--jobs", "0"], "argument --jobs: must be a positive integer, got 0"),
    (["--report-only"], "argument --out:"),
    (["--nonsense-flag"], "unrecognized arguments: --nonsense-flag"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_arguments_give_one_line_and_create_nothing(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _fails(["reproduce", "synthetic", "--out", str(out), *flags], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_gpu_requested_without_one(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _fails(
        ["reproduce", "synthetic", "--out", str(tmp_path / "o"), "--accelerator", "gpu"], capsys
    )
    assert code == 2 and "argument --accelerator: gpu requested, but torch sees no" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["under a file", "read-only"])
def test_unwritable_out(kind, tmp_path, capsys, monkeypatch):
    if kind == "under a file":
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "out", "is a file, not a directory"
    else:
        import tempfile

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)  # root may write anywhere: simulate
        out, expected = tmp_path / "out", "cannot write in"
    code, err = _fails(["reproduce", "synthetic", "--out", str(out)], capsys)
    assert code == 2 and f"argument --out: {out}" in err and expected in err
    assert len(err.strip().splitlines()) == 1


def test_version_and_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "urpe", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == f"urpe {urpe.__version__}"
    done = subprocess.run(
        [sys.executable, "-m", "urpe", "reproduce", "synthetic", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    for flag in (
        "--jobs",
        "--resume",
        "--devices",
        "--num-nodes",
        "--strategy",
        "--precision",
        "--accumulate-grad-batches",
        "--checkpoint-every",
    ):
        assert flag in done.stdout


@pytest.mark.parametrize(
    "argv, hidden, extras",
    [
        (["reproduce", "synthetic"], ["lightning"], "train"),
        (["reproduce", "synthetic"], ["tqdm"], "train"),
        (["predict", "MODEL", "CCO"], ["safetensors", "rdkit", "scipy"], "graph,train"),
        (["evaluate", "MODEL", "x.csv"], ["safetensors", "scipy"], "graph,train"),
        (["reproduce", "graph"], ["lightning", "torch_geometric", "rdkit"], "graph,train"),
    ],
    ids=["lightning", "tqdm", "predict", "evaluate", "reproduce graph"],
)
def test_missing_extras_are_named_at_once(argv, hidden, extras, molecule_model, tmp_path):
    """A wheel-only install: one line names every missing module and the one pip command
    that installs them all; nothing is created."""
    argv = [str(molecule_model) if a == "MODEL" else a for a in argv]
    if argv[0] == "reproduce":
        argv += ["--out", str(tmp_path / "o")]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({hidden!r}))\n"
        "from urpe.cli import main\n"
        f"sys.exit(main({argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    prog = " ".join(["urpe", *argv[: 2 if argv[0] == "reproduce" else 1]])
    names = ", ".join(map(repr, hidden))
    one = len(hidden) == 1
    what = f"the module {names}, which is" if one else f"the modules {names}, which are"
    assert done.stderr.strip().splitlines() == [
        f"{prog}: error: this command needs {what} not installed: pip install 'urpe[{extras}]'"
    ]
    assert not (tmp_path / "o").exists()
