"""The `urpe` commands inside shell scripts: `--output` into a folder that does not exist yet or
that is a folder, checked before any work; SMILES longer than a file name; a reader that goes
away (`| head`) ends the command quietly; progress in a log is lines, never `\\r` frames."""

import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from urpe.cli import PIPE_CLOSED_STATUS, main

# A peptide of 18 alanines: 271 characters (91 atoms), longer than a file name may be (255).
PEPTIDE = "N[C@@H](C)C(=O)" * 18 + "O"


def _predicted(path: Path) -> list[list[str]]:
    return list(csv.reader(path.read_text().splitlines()))


def test_output_into_a_folder_that_does_not_exist_is_created(molecule_model, tmp_path, capsys):
    output = tmp_path / "new" / "dir" / "p.csv"
    assert (
        main(
            ["predict", str(molecule_model), "CCO", "c1ccccc1", "-o", str(output), "--no-progress"]
        )
        == 0
    )
    rows = _predicted(output)
    assert rows[0] == ["smiles", "predicted_heavy"] and [r[0] for r in rows[1:]] == [
        "CCO",
        "c1ccccc1",
    ]
    assert f"to {output}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "as_json, name, given",
    [
        (False, "predictions.csv", "existing"),
        (True, "predictions.json", "existing"),
        (False, "predictions.csv", "new/"),
    ],
)
def test_output_to_a_folder_writes_predictions_inside(
    as_json, name, given, molecule_model, tmp_path, capsys
):
    folder = tmp_path / "results"
    if given == "existing":
        folder.mkdir()
    flags = ["--json"] if as_json else []
    output = str(folder) + ("/" if given == "new/" else "")
    assert main(["predict", str(molecule_model), "CCO", "-o", output, "--no-progress", *flags]) == 0
    assert [p.name for p in folder.iterdir()] == [name]
    assert f"to {folder / name}" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["under a file", "read-only", "a folder at the default name"])
def test_output_that_cannot_be_written_is_refused_before_any_prediction(
    where, molecule_model, tmp_path, capsys, monkeypatch
):
    from urpe.training.bundles import MoleculeModel

    def must_not_run(*args, **kwargs):
        raise AssertionError("predicted before checking --output")

    monkeypatch.setattr(MoleculeModel, "predict", must_not_run)
    if where == "under a file":
        (tmp_path / "file").write_text("")
        output, expected = tmp_path / "file" / "p.csv", "is a file, not a directory"
    elif where == "read-only":

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)  # root may write anywhere: simulate
        output, expected = tmp_path / "p.csv", "cannot write in"
    else:
        (tmp_path / "predictions.csv").mkdir()
        output, expected = tmp_path, "is a folder"
    code = main(["predict", str(molecule_model), "CCO", "-o", str(output), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "argument --output: " in err and expected in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_smiles_longer_than_a_file_name_are_predicted(molecule_model, capsys):
    from urpe import load_model

    assert len(PEPTIDE) > 255
    macrocycle = "C1" + "[CH2]" * 52 + "C1"  # 264 characters, 54 atoms
    assert (
        main(["predict", str(molecule_model), PEPTIDE, macrocycle, "C/C=C/C", "--no-progress"]) == 0
    )
    captured = capsys.readouterr()
    rows = list(csv.reader(captured.out.splitlines()))
    expected = load_model(molecule_model).predict([PEPTIDE, macrocycle, "C/C=C/C"])
    assert [r[0] for r in rows[1:]] == [PEPTIDE, macrocycle, "C/C=C/C"]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(expected, rel=1e-5)
    assert "could not be read" not in captured.err


# -- a reader that goes away -----------------------------------------------------------------


def _quiet(stderr: str) -> bool:
    return not any(word in stderr for word in ("Traceback", "BrokenPipe", "Exception ignored"))


def test_predict_into_a_closed_pipe_exits_quietly(molecule_model):
    """`urpe predict ... | true`: nothing reads stdout; the output is written at the end."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "urpe", "predict", str(molecule_model), "CCO", "c1ccccc1"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == PIPE_CLOSED_STATUS == 141 and _quiet(done.stderr), done.stderr


def test_generate_into_head_exits_quietly(lm_sweep, tmp_path):
    """`urpe generate ... | head -c 50`: the reader leaves while tokens stream."""
    out, _ = lm_sweep
    with open(tmp_path / "stderr", "w+") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "urpe",
                "generate",
                str(out),
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "100000",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        head = process.stdout.read(50)
        process.stdout.close()
        code = process.wait(timeout=120)
        stderr.seek(0)
        err = stderr.read()
    assert head.startswith(b"the cat") and len(head) == 50
    assert code == PIPE_CLOSED_STATUS and _quiet(err), err


def _stdout_without_a_reader(monkeypatch):
    """sys.stdout becomes a pipe whose reader is gone (set in the test itself: pytest's capture
    sets sys.stdout again between a fixture and its test)."""
    read, write = os.pipe()
    os.close(read)
    stream = open(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    return stream


@pytest.mark.parametrize("command", ["evaluate", "help", "version"])
def test_every_command_that_prints_ends_quietly_when_its_reader_goes(
    command, lm_sweep, monkeypatch
):
    out, text = lm_sweep
    argv = {
        "evaluate": ["evaluate", str(out), str(text), "--no-progress"],
        "help": ["predict", "--help"],
        "version": ["--version"],
    }[command]
    stdout = _stdout_without_a_reader(monkeypatch)
    try:
        assert main(argv) == PIPE_CLOSED_STATUS
        stdout.write("what is left in the buffer goes nowhere, without an error\n")
        stdout.flush()
    finally:
        stdout.close()


def test_a_broken_pipe_elsewhere_is_not_hidden(monkeypatch, capsys):
    """Only stdout's reader leaving is quiet: a broken pipe of the command's own still shows."""
    import urpe.experiments.predict as predict

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(predict, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["predict", "somewhere", "CCO"])


# -- progress in a log -----------------------------------------------------------------------


def test_predict_progress_in_a_log_is_lines(molecule_model, capsys):
    assert main(["predict", str(molecule_model), "CCO", "CCN", "CCC", "--batch-size", "1"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    assert "predict: 3/3 batches (100%)" in err
