"""Your own molecules: a CSV (or SDF) read with invalid rows skipped and counted in one line,
RDKit quiet, the cache keyed by content; `reproduce graph --dataset csv:PATH` with one model per
target column (named in any case); `urpe predict` (the input's other columns kept) and
`urpe evaluate` on the trained runs; the report naming the file; bad flags refused up front in
one line. File formats without training: test_molecule_file_formats.py."""

import builtins
import csv
import io
import json
from pathlib import Path

import lightning  # noqa: F401  (the train extra)
import pytest
import torch
from rdkit import Chem
from rdkit.Chem import Crippen

from urpe.cli import main
from urpe.data.molecules import load_molecules, skipped_summary
from urpe.data.molecules.files import read_molecule_table
from urpe.data.molecules.sources import moses_file, read_moses_smiles
from urpe.experiments import runner
from urpe.experiments.graph.molecule_files import file_facts

BAD_LINES = {5: "not_a_smiles", 9: "C1CC"}  # 1-based file lines (line 1 is the header)


def write_csv(path, count=160, start=0):
    """MOSES molecules with two targets computed by RDKit: Crippen logP and heavy atoms."""
    smiles = read_moses_smiles(moses_file("train"))[start : start + count]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["SMILES", "logP", "heavy", "split"])
        for i, text in enumerate(smiles):
            mol = Chem.MolFromSmiles(text)
            line = i + 2
            split = "train" if i % 10 < 7 else "valid" if i % 10 < 9 else "test"
            writer.writerow(
                [
                    BAD_LINES.get(line, text),
                    f"{Crippen.MolLogP(mol):.4f}",
                    mol.GetNumHeavyAtoms(),
                    split,
                ]
            )
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "cache"))


def test_invalid_smiles_are_skipped_counted_in_one_line_and_rdkit_stays_quiet(tmp_path, capfd):
    path = write_csv(tmp_path / "mols.csv", count=40)
    data = load_molecules(f"csv:{path}", target="logp", progress=False)
    assert capfd.readouterr().err == ""  # RDKit's parse errors kept off stderr
    assert len(data.train) + len(data.val) + len(data.test) == 38
    line = skipped_summary(data)
    assert line == "skipped 2 of 40 rows of mols.csv: 2 invalid SMILES (lines 5, 9)"
    first = data.train[0]
    assert first.y.shape == (1,) and first.spd.numel() == first.num_nodes**2


def test_cache_is_keyed_by_content_not_path(tmp_path):
    path = write_csv(tmp_path / "a.csv", count=30)
    first = load_molecules(f"csv:{path}", target="heavy", progress=False)
    copy = tmp_path / "elsewhere" / "b.csv"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    again = load_molecules(f"csv:{copy}", target="heavy", progress=False)
    assert again.path == first.path  # the same entry, found by content
    # ... and named by the file given, not by the first one cached (reports, skip lines)
    assert first.info["file"] == "a.csv" and again.info["file"] == "b.csv"
    assert "of b.csv: 2 invalid SMILES" in skipped_summary(again)
    assert file_facts(again)["data_file"]["name"] == "b.csv"
    write_csv(copy, count=30, start=30)  # edited: other molecules
    edited = load_molecules(f"csv:{copy}", target="heavy", progress=False)
    assert edited.path != first.path
    assert edited.train[0].smiles != first.train[0].smiles or len(edited.train) != len(first.train)


def test_split_column_and_sdf_files(tmp_path):
    path = write_csv(tmp_path / "mols.csv", count=50)
    data = load_molecules(f"csv:{path}", target="heavy", split_column="split", progress=False)
    rows, _ = read_molecule_table(path, "smiles", ["heavy"], "split")
    valid = [r for r in rows if Chem.MolFromSmiles(r.smiles) is not None]
    assert len(data.val) == sum(r.split == "valid" for r in valid)
    assert len(data.test) == sum(r.split == "test" for r in valid)
    assert sorted(float(g.y) for g in data.test) == sorted(
        float(r.targets["heavy"]) for r in valid if r.split == "test"
    )
    sdf = tmp_path / "mols.sdf"
    writer = Chem.SDWriter(str(sdf))
    for text in ("CCO", "c1ccccc1", "CC(=O)O"):
        mol = Chem.MolFromSmiles(text)
        mol.SetProp("weight", str(mol.GetNumHeavyAtoms()))
        writer.write(mol)
    writer.close()
    rows, header = read_molecule_table(sdf, targets=["weight"])
    assert [r.targets["weight"] for r in rows] == ["3", "6", "4"] and "weight" in header


TINY = [
    "--steps",
    "30",
    "--batch-size",
    "16",
    "--lr",
    "2e-3",
    "--eval-every",
    "15",
    "--seeds",
    "0",
    "--variants",
    "graphormer-urpe",
    "--jobs",
    "1",
    "--threads",
    "1",
    "--checkpoint-every",
    "0",
    "--no-progress",
]


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory):
    """Two runs (targets typed `logp,heavy` against the header's `logP`), shared by the tests of
    this module: they only read them."""
    root = tmp_path_factory.mktemp("graph_files")
    path = write_csv(root / "mols.csv")
    out = root / "out"
    argv = ["reproduce", "graph", "--dataset", f"csv:{path}", "--target-column", "logp,heavy"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("URPE_CACHE_DIR", str(root / "cache"))
        assert main([*argv, *TINY, "--out", str(out)]) == 0
    return out, path


def heavy_run(out):
    records = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    (heavy,) = [r for r in records if r["config"]["target"] == "heavy"]
    return out / "runs" / heavy["id"]


@pytest.mark.slow
def test_train_on_a_csv_then_predict_and_evaluate(graph_run, tmp_path, capsys):
    out, path = graph_run
    records = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    # one per target, named as the header names it
    assert sorted(r["config"]["target"] for r in records) == ["heavy", "logP"]
    for record in records:
        assert record["config"]["locations"]["dataset"] == str(path.resolve())
        assert record["config"]["dataset"].startswith("csv:sha256-")
        assert sum(record["result"]["sizes"]) == 158
    (heavy,) = [r for r in records if r["config"]["target"] == "heavy"]
    run_dir = out / "runs" / heavy["id"]
    capsys.readouterr()
    assert main(["predict", str(run_dir), "CCO", "c1ccccc1", "C1CC", "--no-progress"]) == 0
    captured = capsys.readouterr()
    rows = list(csv.reader(captured.out.splitlines()))
    assert rows[0] == ["smiles", "predicted_heavy"] and rows[3] == ["C1CC", ""]
    assert "1 of 3 SMILES could not be read" in captured.err
    from urpe import load_model

    model = load_model(run_dir)
    assert model.target == "heavy" and model.features == "zinc"
    expected = model.predict(["CCO", "c1ccccc1"])
    assert [float(rows[1][1]), float(rows[2][1])] == pytest.approx(expected, rel=1e-5)
    # evaluate = the MAE of predict's numbers against the file's values
    test_csv = write_csv(tmp_path / "test.csv", count=40, start=500)
    assert main(["evaluate", str(run_dir), str(test_csv), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows, _ = read_molecule_table(test_csv, "smiles", ["heavy"])
    predicted = model.predict([r.smiles for r in rows])
    errors = [
        abs(p - float(r.targets["heavy"]))
        for p, r in zip(predicted, rows, strict=True)
        if p is not None
    ]
    assert result["molecules"] == 38 and result["skipped"] == 2
    assert result["mae"] == pytest.approx(sum(errors) / len(errors), rel=1e-6)
    assert result["unit"] == ""  # the file's own units, unnamed
    # the whole sweep folder holds two targets: no validation MAE ranks them, so it asks
    code = main(["predict", str(out), str(test_csv), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "holds runs on 2 different data" in err and err.count("\n") == 1
    assert "(mols.csv, heavy, finished " in err and "(mols.csv, logP, finished " in err


def test_predict_keeps_the_inputs_other_columns(graph_run, tmp_path, capsys):
    """The user's IDs used to be dropped: the output held only smiles and the prediction."""
    run_dir = heavy_run(graph_run[0])
    table = tmp_path / "ids.csv"  # a European spreadsheet's export with an ID column first
    table.write_bytes("\ufeffID;SMILES;note\r\nA-1;CCO;first\r\nA-2;C1CC;bad\r\n".encode())
    smi = tmp_path / "more.smi"
    smi.write_text("c1ccccc1 benzene ring\n")
    output = tmp_path / "predictions.csv"
    capsys.readouterr()
    argv = ["predict", str(run_dir), str(table), str(smi), "CC", "--no-progress"]
    assert main([*argv, "-o", str(output)]) == 0
    rows = list(csv.reader(output.open()))
    assert rows[0] == ["smiles", "ID", "note", "name", "predicted_heavy"]
    assert rows[1][:4] == ["CCO", "A-1", "first", ""] and rows[2] == ["C1CC", "A-2", "bad", "", ""]
    assert rows[3][:4] == ["c1ccccc1", "", "", "benzene ring"] and rows[4][:4] == ["CC", "", "", ""]
    assert all(float(row[4]) for row in (rows[1], rows[3], rows[4]))
    err = capsys.readouterr().err
    assert f"wrote 4 predictions of heavy to {output}" in err and "units of" not in err
    assert main([*argv, "--json"]) == 0
    predictions = json.loads(capsys.readouterr().out)["predictions"]
    assert predictions[0]["columns"] == {"ID": "A-1", "note": "first"}
    assert "columns" not in predictions[3]


def test_the_report_names_the_file_its_rows_and_splits(graph_run):
    """It named the file only by its content hash, showed a ZINC paper column for the user's
    data, and wrote "logp (units of 'logp')"."""
    out, _ = graph_run
    text = (out / "results.md").read_text()
    record = json.loads(next((out / "records").glob("*.json")).read_text())
    digest = record["config"]["data"]["file"]["sha256"][:12]
    train, val, test = record["result"]["sizes"]
    assert f"| mols.csv | {record['config']['target']} | " in text
    assert f"| {train}/{val}/{test} |" in text
    assert f"- mols.csv (sha256 {digest}), target logP: 160 rows, 2 skipped" in text
    assert f"- mols.csv (sha256 {digest}), target heavy: 160 rows, 2 skipped" in text
    assert "paper" not in text.lower() and "units of" not in text and "csv:sha256" not in text


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ([], "argument --target-column: "),
        (["--target-column", "nope"], "argument --target-column: mols.csv has no column 'nope'"),
        (["--target-column", "logp", "--smiles-column", "smi"], "argument --smiles-column"),
        (["--target-column", "logp", "--sizes", "2,1,1"], "each >= 2"),
        (["--target-column", "logp", "--sizes", "1,1,1"], "each >= 2"),
    ],
)
def test_bad_file_flags_are_refused_up_front(flags, fragment, tmp_path, capsys):
    path = write_csv(tmp_path / "mols.csv", count=20)
    out = tmp_path / "out"
    try:
        code = main(["reproduce", "graph", "--dataset", f"csv:{path}", *flags, "--out", str(out)])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / "cache").exists()  # nothing built


def test_sizes_too_small_for_a_report_are_refused_before_training(tmp_path, capsys):
    """`--sizes 2,1,1` used to train and then fail writing a NaN into JSON; `1,1,1` failed
    after building the data. Both are refused by the argument check; a file too small to give
    every split two molecules is refused after reading it, before any training."""
    path = write_csv(tmp_path / "mols.csv", count=12)
    out = tmp_path / "out"
    code = main(
        [
            "reproduce",
            "graph",
            "--dataset",
            f"csv:{path}",
            "--target-column",
            "logp",
            *TINY,
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "every split needs at least 2 molecules" in err
    assert not (out / "records").exists()


def test_saved_graphormer_predicts_in_the_targets_units(tmp_path):
    from urpe import load_model, save_model
    from urpe.data.molecules import FEATURIZATIONS
    from urpe.graph import Graphormer, GraphormerConfig

    spec = FEATURIZATIONS["zinc"]
    torch.manual_seed(0)
    model = Graphormer(
        GraphormerConfig.preset("tiny"),
        node_cardinalities=spec.node_cardinalities,
        edge_cardinalities=spec.edge_cardinalities,
    )
    inputs = {"kind": "molecules", "features": "zinc", "target": "heavy", "unit": "atoms"}
    save_model(model, tmp_path / "model", inputs=inputs)
    loaded = load_model(tmp_path / "model")
    plain = loaded.predict(["CCO", "bad(", "c1ccccc1"])
    assert plain[1] is None and loaded.unit == "atoms"
    model.set_target_statistics(10.0, 3.0)  # normalisation travels in the weights
    save_model(model, tmp_path / "model", inputs=inputs)
    scaled = load_model(tmp_path / "model")
    assert scaled.normalization == {"mean": 10.0, "std": 3.0}
    shifted = scaled.predict(["CCO", "bad(", "c1ccccc1"])
    for a, b in ((plain[0], shifted[0]), (plain[2], shifted[2])):
        assert b == pytest.approx(10.0 + 3.0 * a, rel=1e-5)


def test_the_users_file_is_read_once_before_the_first_run(tmp_path, monkeypatch):
    """It was read or hashed six times (columns checked, hashed for the plan, columns again,
    hashed to check it, hashed for the cache key, read into graphs) before any run began."""
    path = write_csv(tmp_path / "mols.csv", count=40)
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).resolve() == path.resolve():
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)  # what Path.read_bytes and gzip open with
    started = []
    monkeypatch.setattr(runner, "sweep_command", lambda *args: started.append(len(opened)) or 0)
    argv = [
        "reproduce",
        "graph",
        "--dataset",
        f"csv:{path}",
        "--target-column",
        "logp,heavy",
        *TINY,
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    assert started == [1]  # the plan, both targets' columns and the data from one read


def test_training_predict_and_evaluate_share_one_featurizer(graph_run):
    """The run's checkpoint records the featuriser its data was made with; the loaded model
    turns a SMILES into exactly the graph the training data holds for it."""
    out, path = graph_run
    run_dir = heavy_run(out)
    step = next((run_dir / "checkpoints").glob("step-*"))
    record = json.loads((step / "config.json").read_text())["inputs"]
    assert record == {
        "kind": "molecules",
        "target": "heavy",
        "unit": "",
        "featurizer": {"features": "zinc", "max_distance": None, "shortest_paths": True},
    }
    from urpe import load_model

    model = load_model(run_dir)
    data = load_molecules(f"csv:{path}", target="heavy", progress=False)
    assert model.featurizer == data.featurizer
    graphs = [data.test[i] for i in range(len(data.test))]
    for graph, made in zip(graphs, model.graphs([g.smiles for g in graphs]), strict=True):
        for name in ("x", "edge_index", "edge_attr", "spd", "path_next_edge"):
            assert torch.equal(getattr(graph, name), getattr(made, name))
