"""The user's molecule file as rows of text cells under its header, however it was saved.

    table = load_table("my.csv", "smiles", ["logP"])   # table.rows, table.targets, table.header

- Text tables (`.csv`, `.tsv`, `.txt`, optionally `.gz`): the separator is whichever of tab, `;`
  and `,` the header line holds most of (ties in that order; `.tsv` is always tab), so a European
  spreadsheet's `smiles;logP` with `0,25` in its cells reads as saved. In a `;` file a decimal
  comma in a target cell becomes a point ("0,25" -> "0.25"); in a tab, SMILES or SDF file too,
  except "1,234", which could be a thousand (left as it is: skipped as not a number, counted).
- SMILES files (`.smi`, `.smiles`, or a text file whose header line has none of the three):
  RDKit's `SmilesMolSupplier` layout: a SMILES, whitespace, an optional name (the rest of the
  line), as columns `smiles` and `name`. A first line whose first field is a word, not a
  molecule (`SMILES Name logP`), is a title line naming the columns; a line's fields then split
  on whitespace, the last of several columns taking the rest. Blank lines and `#` comments are
  skipped.
- SDF (`.sdf`, `.sdf.gz`): each record's molecule (canonical SMILES, column `smiles`) and its
  properties as columns.
- Encodings: UTF-8 with or without Excel's BOM; UTF-16 with a BOM (Excel's "Unicode Text");
  anything else is read as Windows-1252 (Excel's plain "CSV" in Western Europe), which changes
  names only: SMILES and numbers are ASCII. CRLF and LF line ends alike.
- Columns are named exactly, else in any case; the rest of the code uses the header's spelling.
  A header line that is data (`CCO,0.25`) is refused with the line to add.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SEPARATORS = ("\t", ";", ",")  # preferred in this order on a tie
SMILES_SUFFIXES = (".smi", ".smiles")
_DECIMAL_COMMA = re.compile(r"[+-]?(\d+,\d*|,\d+)([eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(,\d{3})+")
_TITLE_WORD = re.compile(r"[A-Za-z_][A-Za-z_.-]*")


class MoleculeFileError(ValueError):
    """The file cannot be used as asked; the message says why in one line. `setting` names the
    argument at fault ("smiles_column", "target", "split_column") or None for the file."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class MoleculeRow:
    """One molecule of a file: its SMILES, its targets' texts and its split, as read."""

    line: int  # 1-based line (text) or record (SDF) number, for messages
    smiles: str
    targets: dict[str, str]  # the header's column name -> text, with a decimal point
    split: str | None
    cells: dict[str, str]  # every column of the row, as read


@dataclass(frozen=True)
class MoleculeTable:
    """A file's rows and the header's own names for the columns asked for."""

    header: list[str]
    rows: list[MoleculeRow]
    smiles_column: str
    targets: list[str]
    split_column: str | None
    separator: str | None  # None: a SMILES file or SDF


def finite_number(text: str) -> float | None:
    """A target cell as a finite number; None for an empty cell, text, inf or nan."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _decode(raw: bytes, path: Path) -> str:
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError as error:
            raise MoleculeFileError(f"{path} is not UTF-16 text ({error.reason})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def _raw(path: Path, content: bytes | None) -> bytes:
    """The file's bytes, uncompressed: `content` when the caller has read them already."""
    if content is None:
        content = path.read_bytes()
    return gzip.decompress(content) if path.name.endswith(".gz") else content


def _separator(first_line: str, name: str) -> str | None:
    if ".tsv" in name:
        return "\t"
    best = max(SEPARATORS, key=first_line.count)  # the first of the most frequent
    return best if first_line.count(best) else None


def _is_molecule(text: str, atoms: int = 1) -> bool:
    from rdkit import Chem, rdBase

    if not text:
        return False
    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(text)
    return mol is not None and mol.GetNumAtoms() >= atoms


def _is_number(text: str) -> bool:
    try:
        float(decimal_point(text))
    except ValueError:
        return False
    return True


def decimal_point(text: str, thousands_possible: bool = False) -> str:
    """ "0,25" -> "0.25" (a number written with a decimal comma); anything else unchanged, and
    "1,234" too where the comma may separate thousands."""
    if thousands_possible and _THOUSANDS.fullmatch(text):
        return text
    return text.replace(",", ".") if _DECIMAL_COMMA.fullmatch(text) else text


def _unambiguous_decimal_point(text: str) -> str:
    return decimal_point(text, thousands_possible=True)


def _read_delimited(text: str, separator: str) -> tuple[list[str], list[tuple[int, dict]]]:
    csv.field_size_limit(10**9)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=separator)
    header = [cell.strip() for cell in next(reader, [])]
    rows = []
    for row in reader:
        if any(cell.strip() for cell in row):
            rows.append((reader.line_num, dict(zip(header, row, strict=False))))
    return header, rows


def _read_smiles_lines(text: str) -> tuple[list[str], list[tuple[int, dict]]]:
    lines = [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    header = ["smiles", "name"]
    if lines:
        first = lines[0][1].split()[0]
        if _TITLE_WORD.fullmatch(first) and not _is_molecule(first):
            header = lines.pop(0)[1].split()
    rows = []
    for number, line in lines:
        fields = line.split(None, len(header) - 1) if len(header) > 1 else line.split()[:1]
        fields += [""] * (len(header) - len(fields))
        rows.append((number, dict(zip(header, fields, strict=True))))
    return header, rows


def _read_sdf(raw: bytes) -> tuple[list[str], list[tuple[int, dict]]]:
    from rdkit import Chem, rdBase

    header: dict[str, None] = {"smiles": None}
    rows = []
    with rdBase.BlockLogs():
        for number, mol in enumerate(Chem.ForwardSDMolSupplier(io.BytesIO(raw)), start=1):
            if mol is None:
                rows.append((number, {"smiles": ""}))
                continue
            values = {name: str(mol.GetProp(name)) for name in mol.GetPropNames()}
            header.update(dict.fromkeys(values))
            rows.append((number, {"smiles": Chem.MolToSmiles(mol), **values}))
    return list(header), rows


def find_column(header: Sequence[str], wanted: str, setting: str, path: Path) -> str:
    """The header's name for `wanted` (exact, else case-insensitive)."""
    if wanted in header:
        return wanted
    folded = [h for h in header if h.strip().lower() == wanted.strip().lower()]
    if len(folded) == 1:
        return folded[0]
    raise MoleculeFileError(
        f"{path.name} has no column {wanted!r}; its columns: {', '.join(header)}", setting
    )


def _header_is_data(header: list[str], separator: str, path: Path) -> MoleculeFileError | None:
    """The error for a file without a header line (its first line holds a molecule or a number),
    naming the line to add; None when the first line looks like column names."""
    molecules = [_is_molecule(cell, atoms=2) for cell in header]
    if not any(molecules) and not any(_is_number(cell) for cell in header):
        return None
    names = [f"column{i + 1}" for i in range(len(header))]
    names[molecules.index(True) if any(molecules) else 0] = "smiles"
    return MoleculeFileError(
        f"{path.name} has no header row: its first line {separator.join(header)!r} is data; add "
        f"a first line naming the columns, e.g. {separator.join(names)!r}, and pass those names "
        "to --smiles-column and --target-column"
    )


def load_table(
    path: str | os.PathLike,
    smiles_column: str = "smiles",
    targets: Sequence[str] = (),
    split_column: str | None = None,
    content: bytes | None = None,
) -> MoleculeTable:
    """The rows of a molecule file (see the module docstring) and its columns' own names.
    `content`: the file's bytes, when already read (the file is then not opened)."""
    path = Path(path)
    if content is None and not path.is_file():
        raise MoleculeFileError(f"no such file: {path}")
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        raise MoleculeFileError(f"{path.name}: Parquet is not read; save it as CSV first")
    separator = None
    if name.endswith((".sdf", ".sdf.gz")):
        header, raw = _read_sdf(_raw(path, content))
        smiles_column = "smiles"  # the molecule itself
    else:
        text = _decode(_raw(path, content), path)
        if not text.strip():
            raise MoleculeFileError(f"{path} is empty (a header row is needed)")
        first_line = next(line for line in text.splitlines() if line.strip())
        if not name.removesuffix(".gz").endswith(SMILES_SUFFIXES):
            separator = _separator(first_line, name)
        try:
            if separator is None:
                header, raw = _read_smiles_lines(text)
            else:
                header, raw = _read_delimited(text, separator)
        except csv.Error as error:
            raise MoleculeFileError(f"{path} is not a readable CSV file ({error})") from None
    try:
        smiles_at = find_column(header, smiles_column, "smiles_column", path)
    except MoleculeFileError as error:
        no_header = separator is not None and _header_is_data(header, separator, path)
        raise (no_header or error) from None
    target_at = [find_column(header, t, "target", path) for t in targets]
    split_at = (
        None if split_column is None else find_column(header, split_column, "split_column", path)
    )
    point = {",": str, ";": decimal_point}.get(separator, _unambiguous_decimal_point)
    rows = [
        MoleculeRow(
            line=line,
            smiles=(cells.get(smiles_at) or "").strip(),
            targets={t: point((cells.get(t) or "").strip()) for t in target_at},
            split=None if split_at is None else (cells.get(split_at) or "").strip(),
            cells=cells,
        )
        for line, cells in raw
    ]
    return MoleculeTable(header, rows, smiles_at, target_at, split_at, separator)


def read_molecule_table(
    path: str | os.PathLike,
    smiles_column: str = "smiles",
    targets: Sequence[str] = (),
    split_column: str | None = None,
) -> tuple[list[MoleculeRow], list[str]]:
    """Rows of a molecule file with the chosen columns, and the file's header."""
    table = load_table(path, smiles_column, targets, split_column)
    return table.rows, table.header
