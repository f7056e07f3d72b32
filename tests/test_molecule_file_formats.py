"""The molecule files users keep, read without training: any case of a column name, European
spreadsheets (`;` and decimal commas), Excel's BOM, CRLF and code pages, `.smi` files,
header-less files named as such, and duplicate molecules warned about and kept in one split."""

import pytest
from rdkit import Chem
from rdkit.Chem import Crippen

from urpe.cli import main
from urpe.data.molecules import load_molecules, skipped_summary
from urpe.data.molecules.files import MoleculeFileError, read_molecule_table
from urpe.data.molecules.sources import moses_file, read_moses_smiles
from urpe.experiments.graph.molecule_files import check_data, dataset_argument

MOLECULES = read_moses_smiles(moses_file("train"))[:40]
SPLITS = ("train", "val", "test")


def logp(smiles: str) -> float:
    return round(Crippen.MolLogP(Chem.MolFromSmiles(smiles)), 4)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_target_column_in_another_case_reads_the_headers_values(tmp_path):
    """`--target-column logp` against a header `logP` found the column but read every value by
    the typed spelling: every row was "without a number"."""
    path = tmp_path / "mols.csv"
    path.write_text("SMILES,logP\n" + "".join(f"{s},{logp(s)}\n" for s in MOLECULES[:20]))
    data = load_molecules(f"csv:{path}", target="LOGP", progress=False)
    assert skipped_summary(data) is None
    assert len(data.train) + len(data.val) + len(data.test) == 20
    assert data.target == "logP"  # the file's own spelling, everywhere after the lookup
    values = sorted(float(g.y) for split in (data.train, data.val, data.test) for g in split)
    assert values == pytest.approx(sorted(logp(s) for s in MOLECULES[:20]), abs=1e-4)


def european(rows, bom=True) -> bytes:
    """Excel's German/French "CSV UTF-8" export: BOM, `;` between cells, decimal commas, CRLF."""
    lines = ["smiles;name;logP"] + [
        f"{s};mol {i};{str(v).replace('.', ',')}" for i, (s, v) in enumerate(rows)
    ]
    return ("\ufeff" if bom else "").encode() + "\r\n".join(lines).encode() + b"\r\n"


def test_semicolons_decimal_commas_bom_and_crlf_just_work(tmp_path):
    pairs = [(s, logp(s)) for s in MOLECULES[:20]]
    path = tmp_path / "export.csv"
    path.write_bytes(european(pairs))
    rows, header = read_molecule_table(path, "smiles", ["logp"])
    assert header == ["smiles", "name", "logP"]
    assert [(r.smiles, float(r.targets["logP"])) for r in rows] == pairs
    assert rows[3].cells["name"] == "mol 3" and rows[0].line == 2
    data = load_molecules(f"csv:{path}", target="logP", progress=False)
    assert skipped_summary(data) is None and sum(len(data.split(s)) for s in SPLITS) == 20


def test_a_comma_file_with_semicolons_inside_quoted_names_stays_a_comma_file(tmp_path):
    path = tmp_path / "quoted.csv"
    path.write_text('smiles,name,logp\r\nCCO,"ethanol; alcohol",-0.0014\r\nc1ccccc1,x,1.69\r\n')
    rows, header = read_molecule_table(path, "smiles", ["logp"])
    assert header == ["smiles", "name", "logp"] and rows[0].cells["name"] == "ethanol; alcohol"
    assert [r.targets["logp"] for r in rows] == ["-0.0014", "1.69"]


def test_excels_code_page_and_utf16_exports_are_read(tmp_path):
    """Excel's plain "CSV" export is Windows-1252; its "Unicode Text" export is UTF-16 with tabs."""
    ansi = tmp_path / "ansi.csv"
    ansi.write_bytes("smiles;name;logP\r\nCCO;Äthanol;-0,0014\r\n".encode("cp1252"))
    rows, _ = read_molecule_table(ansi, "smiles", ["logp"])
    assert rows[0].cells["name"] == "Äthanol" and rows[0].targets["logP"] == "-0.0014"
    unicode = tmp_path / "unicode.txt"
    unicode.write_bytes("smiles\tname\tlogP\r\nCCO\tÄthanol\t-0,0014\r\n".encode("utf-16"))
    rows, _ = read_molecule_table(unicode, "smiles", ["logp"])
    assert rows[0].cells["name"] == "Äthanol" and rows[0].targets["logP"] == "-0.0014"


def test_a_comma_that_may_separate_thousands_is_not_read_as_a_decimal_one(tmp_path):
    """In a `;` file a comma is the decimal mark; in a tab file "1,234" may be a thousand."""
    cells = ["0,25", "1,234", "12,5", "1.5", "n/a"]
    semicolons, tabs = tmp_path / "a.csv", tmp_path / "b.tsv"
    semicolons.write_text("smiles;y\n" + "".join(f"C;{c}\n" for c in cells))
    tabs.write_text("smiles\ty\n" + "".join(f"C\t{c}\n" for c in cells))

    def read(path):
        return [row.targets["y"] for row in read_molecule_table(path, targets=["y"])[0]]

    assert read(semicolons) == ["0.25", "1.234", "12.5", "1.5", "n/a"]
    assert read(tabs) == ["0.25", "1,234", "12.5", "1.5", "n/a"]


def test_smi_files_with_and_without_a_title_line(tmp_path):
    plain = tmp_path / "plain.smi"  # SMILES, whitespace, an optional name (spaces allowed)
    plain.write_bytes(b"\xef\xbb\xbfCCO ethanol\r\nc1ccccc1\tbenzene ring\r\n\r\nCC(=O)O\r\n")
    rows, header = read_molecule_table(plain)
    assert header == ["smiles", "name"]
    assert [(r.smiles, r.cells["name"], r.line) for r in rows] == [
        ("CCO", "ethanol", 1),
        ("c1ccccc1", "benzene ring", 2),
        ("CC(=O)O", "", 4),
    ]
    titled = tmp_path / "titled.smi"  # RDKit's SmilesMolSupplier: a title line names columns
    titled.write_text(
        "SMILES Name logP\n"
        + "".join(f"{s} m{i} {logp(s)}\n" for i, s in enumerate(MOLECULES[:20]))
    )
    rows, header = read_molecule_table(titled, targets=["logp"])
    assert header == ["SMILES", "Name", "logP"] and rows[1].cells["Name"] == "m1"
    assert dataset_argument(str(titled)) == f"csv:{titled.resolve()}"
    data = load_molecules(f"csv:{titled}", target="logP", progress=False)
    assert skipped_summary(data) is None and len(data.train) == 16


@pytest.mark.parametrize(
    "content, fragment",
    [
        (
            "CCO,0.25\nc1ccccc1,1.5\n",
            "mols.csv has no header row: its first line 'CCO,0.25' is "
            "data; add a first line naming the columns, e.g. 'smiles,column2'",
        ),
        (
            "CCO;0,25\nc1ccccc1;1,5\n",
            "its first line 'CCO;0,25' is data; add a first line "
            "naming the columns, e.g. 'smiles;column2'",
        ),
        (
            "molecule,logp\nCCO,0.25\n",
            "mols.csv has no column 'smiles'; its columns: molecule, logp",
        ),
    ],
)
def test_a_missing_header_is_named_with_what_to_add(content, fragment, tmp_path, capsys):
    path = tmp_path / "mols.csv"
    path.write_text(content)
    with pytest.raises(MoleculeFileError) as error:
        read_molecule_table(path, "smiles", ["logp"])
    assert fragment in str(error.value)
    out = tmp_path / "out"
    code = main(
        ["reproduce", "graph", "--dataset", str(path), "--target-column", "logp", "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1, err


def test_duplicates_are_warned_about_and_never_cross_splits(tmp_path):
    """Each molecule twice (the second copy in Kekulé form), half of them with another value:
    the random split used to put copies of test molecules into train."""
    lines = ["smiles,logp"] + [f"{s},{logp(s)}" for s in MOLECULES]
    for i, s in enumerate(MOLECULES):
        kekule = Chem.MolToSmiles(Chem.MolFromSmiles(s), kekuleSmiles=True)
        lines.append(f"{kekule},{logp(s) + (1.0 if i % 2 else 0.0)}")
    path = tmp_path / "mols.csv"
    path.write_text("\n".join(lines) + "\n")
    data = load_molecules(f"csv:{path}", target="logp", progress=False)
    canonical = {
        split: {Chem.MolToSmiles(Chem.MolFromSmiles(g.smiles)) for g in data.split(split)}
        for split in SPLITS
    }
    assert not canonical["train"] & canonical["val"] and not canonical["train"] & canonical["test"]
    assert not canonical["val"] & canonical["test"]
    assert [len(data.split(s)) for s in SPLITS] == [64, 8, 8]  # 32/4/4 molecules, twice
    from urpe.data.molecules.files import duplicates_summary

    line = duplicates_summary(data)
    assert line.startswith(
        "mols.csv: 40 molecules appear on more than one row (80 rows); 20 of "
        "them with different values of 'logp' (e.g. "
    )
    assert "all rows kept, each molecule's rows in one split" in line and "\n" not in line
    assert data.info["duplicates"]["conflicting"] == 20
    said = []
    check_data(data, said.append)  # what `urpe reproduce graph` prints before training
    assert said == [line]
