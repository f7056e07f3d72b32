"""The user's own molecules: a CSV (or TSV, or SDF) file with SMILES and one or more targets.

    data = load_molecule_file("my.csv", target="solubility")            # 80/10/10, seed 0
    data = load_molecule_file("my.csv", target="y", split_column="split")  # the file's split

- CSV / TSV (`.csv`, `.tsv`, `.txt`, optionally `.gz`): a header row; the SMILES column is found
  by name (case-insensitive, default "smiles"); each target column must hold numbers. Read with
  the standard `csv` module (no pandas). SDF (`.sdf`, `.sdf.gz`): each record's molecule
  (written out as canonical SMILES) and its properties as columns. Parquet is not read: save it
  as CSV first.
- A row whose SMILES RDKit cannot read, or whose target is empty or not a number, is skipped and
  counted; `skipped_summary(dataset)` gives the one line that says how many and on which lines.
  RDKit's own parse messages are kept off stderr.
- Split: with `split_column`, its values say train / val (or valid, validation) / test per row;
  without, one seeded permutation gives 80/10/10. `sizes` caps each split (its first rows).
- The cache entry is keyed by the file's content (SHA-256), never by its path: an edited file is
  rebuilt, a moved or renamed one is found again.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...files import file_sha256

FILE_KINDS = ("csv", "sdf")  # dataset spec prefixes: csv:PATH, sdf:PATH
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)
SHOWN_LINES = 5  # line numbers named in the skipped-rows summary


class MoleculeFileError(ValueError):
    """The file cannot be used as asked; the message says why in one line. `setting` names the
    argument at fault ("smiles_column", "target", "split_column") or None for the file."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class MoleculeRow:
    line: int  # 1-based line (CSV) or record (SDF) number, for messages
    smiles: str
    targets: dict[str, str]  # column -> text as read
    split: str | None


def parse_file_spec(spec: str) -> tuple[str, Path] | None:
    """ "csv:PATH" / "sdf:PATH" -> (kind, absolute path); None for anything else."""
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in FILE_KINDS or not rest:
        return None
    return kind, Path(rest).expanduser().resolve()


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _column(header: Sequence[str], wanted: str, setting: str, path: Path) -> str:
    """The header's name for `wanted` (exact, else case-insensitive)."""
    if wanted in header:
        return wanted
    folded = [h for h in header if h.strip().lower() == wanted.strip().lower()]
    if len(folded) == 1:
        return folded[0]
    raise MoleculeFileError(
        f"{path.name} has no column {wanted!r}; its columns: {', '.join(header)}", setting
    )


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    csv.field_size_limit(10**9)
    try:
        with _open_text(path) as handle:
            sample = handle.read(65536)
            handle.seek(0)
            tabs = ".tsv" in path.name or sample.count("\t") > sample.count(",")
            delimiter = "\t" if tabs else ","
            reader = csv.reader(handle, delimiter=delimiter)
            header = next(reader, None)
            if not header:
                raise MoleculeFileError(f"{path} is empty (a header row is needed)")
            header = [h.strip() for h in header]
            rows = []
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                rows.append((reader.line_num, dict(zip(header, row, strict=False))))
    except UnicodeDecodeError as error:
        raise MoleculeFileError(f"{path} is not UTF-8 text ({error.reason})") from None
    except csv.Error as error:
        raise MoleculeFileError(f"{path} is not a readable CSV file ({error})") from None
    return header, rows


def _read_sdf(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    from rdkit import Chem, rdBase

    opener = gzip.open if path.name.endswith(".gz") else open
    header: dict[str, None] = {"smiles": None}
    rows = []
    with opener(path, "rb") as handle, rdBase.BlockLogs():
        for number, mol in enumerate(Chem.ForwardSDMolSupplier(handle), start=1):
            if mol is None:
                rows.append((number, {"smiles": ""}))
                continue
            values = {name: str(mol.GetProp(name)) for name in mol.GetPropNames()}
            header.update(dict.fromkeys(values))
            rows.append((number, {"smiles": Chem.MolToSmiles(mol), **values}))
    return list(header), rows


def read_molecule_table(
    path: str | os.PathLike,
    smiles_column: str = "smiles",
    targets: Sequence[str] = (),
    split_column: str | None = None,
) -> tuple[list[MoleculeRow], list[str]]:
    """Rows of a molecule file with the chosen columns, and the file's header."""
    path = Path(path)
    if not path.is_file():
        raise MoleculeFileError(f"no such file: {path}")
    sdf = path.name.endswith((".sdf", ".sdf.gz"))
    if path.name.endswith((".parquet", ".pq")):
        raise MoleculeFileError(f"{path.name}: Parquet is not read; save it as CSV first")
    header, raw = _read_sdf(path) if sdf else _read_csv(path)
    smiles_at = "smiles" if sdf else _column(header, smiles_column, "smiles_column", path)
    target_at = [_column(header, t, "target", path) for t in targets]
    split_at = None if split_column is None else _column(header, split_column, "split_column", path)
    rows = [
        MoleculeRow(
            line=line,
            smiles=(cells.get(smiles_at) or "").strip(),
            targets={t: (cells.get(t) or "").strip() for t in target_at},
            split=None if split_at is None else (cells.get(split_at) or "").strip(),
        )
        for line, cells in raw
    ]
    return rows, header


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def assign_splits(
    rows: Sequence[MoleculeRow], split_column: str | None, seed: int
) -> dict[str, list[int]]:
    """Row indices per split: the split column's values, else an 80/10/10 seeded permutation."""
    if split_column is not None:
        out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
        bad: dict[str, int] = {}
        for i, row in enumerate(rows):
            name = SPLIT_NAMES.get((row.split or "").lower())
            if name is None:
                bad.setdefault(row.split or "", row.line)
            else:
                out[name].append(i)
        if bad:
            shown = ", ".join(f"{v!r} (line {line})" for v, line in list(bad.items())[:3])
            raise MoleculeFileError(
                f"split column {split_column!r} holds {shown}; expected train, val (or valid) "
                "or test",
                "split_column",
            )
        return out
    order = np.random.default_rng(seed).permutation(len(rows)).tolist()
    n_train = int(len(rows) * DEFAULT_FRACTIONS[0])
    n_val = int(len(rows) * DEFAULT_FRACTIONS[1])
    return {
        "train": order[:n_train],
        "val": order[n_train : n_train + n_val],
        "test": order[n_train + n_val :],
    }


def skipped_summary(dataset: Any) -> str | None:
    """One line on the rows a file dataset skipped (how many, the first few lines), or None."""
    skipped = (getattr(dataset, "info", None) or {}).get("skipped")
    if not skipped or not skipped.get("count"):
        return None
    return skipped_line(skipped, dataset.info.get("source_rows", 0), dataset.info.get("file"))


def skipped_line(skipped: dict[str, Any], total: int, name: str | None) -> str:
    parts = []
    for reason, lines in skipped["reasons"].items():
        if lines:
            shown = ", ".join(map(str, lines[:SHOWN_LINES]))
            more = ", ..." if len(lines) > SHOWN_LINES else ""
            parts.append(
                f"{len(lines)} {reason} (line{'s' if len(lines) > 1 else ''} {shown}{more})"
            )
    where = f" of {name}" if name else ""
    return f"skipped {skipped['count']} of {total} rows{where}: " + "; ".join(parts)


def featurize_rows(
    rows: Sequence[MoleculeRow],
    target: str | None,
    features: str,
    transform: Callable | None,
    progress: bool = False,
    description: str = "molecules",
) -> tuple[list[Any], dict[str, list[int]]]:
    """Graphs of the rows (y = the target, when given) and the lines skipped, by reason."""
    import torch
    from rdkit import rdBase

    from ...progress import progress_bar
    from .featurize import smiles_to_graph

    graphs, invalid, no_target = [], [], []
    with rdBase.BlockLogs():  # a skipped molecule is counted, not printed by RDKit
        for row in progress_bar(rows, desc=description, unit="molecule", enabled=progress):
            value = None
            if target is not None:
                value = _number(row.targets.get(target, ""))
                if value is None:
                    no_target.append(row.line)
                    continue
            parsed = smiles_to_graph(row.smiles, features) if row.smiles else None
            if parsed is None:
                invalid.append(row.line)
                continue
            data, _ = parsed
            if value is not None:
                data.y = torch.tensor([value], dtype=torch.float32)
            data.smiles = row.smiles
            if transform is not None:
                data = transform(data)
            graphs.append(data)
    reasons = {"invalid SMILES": invalid}
    if target is not None:
        reasons[f"without a number in {target!r}"] = no_target
    return graphs, reasons


def load_molecule_file(
    path: str | os.PathLike,
    *,
    target: str,
    smiles_column: str = "smiles",
    split_column: str | None = None,
    sizes: Sequence[int] | None = None,
    seed: int = 0,
    features: str = "zinc",
    max_distance: int | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    rebuild: bool = False,
):
    """A `MoleculeDataset` from the user's file (see the module docstring), cached by content.

    Args:
        path: a CSV/TSV (optionally gzipped) or SDF file.
        target: the target column (numbers; its units are the file's).
        smiles_column: the SMILES column (case-insensitive; SDF files give the molecule itself).
        split_column: a column of train / val / test per row; None: a seeded 80/10/10 split.
        sizes: (train, val, test) caps; None: every row.
        seed, features, max_distance, cache_dir, progress, rebuild: as `load_molecules`.
    """
    from ...graph.paths import ShortestPaths
    from .cache import cache_key, cache_root, load_entry, save_entry
    from .datasets import SPLITS, GraphSplit, MoleculeDataset, _stats
    from .featurize import FEATURIZATIONS

    path = Path(path).expanduser().resolve()
    if features not in FEATURIZATIONS:
        raise MoleculeFileError(f"features must be one of {', '.join(FEATURIZATIONS)}")
    if not path.is_file():
        raise MoleculeFileError(f"no such file: {path}")
    sizes = None if sizes is None else tuple(int(s) for s in sizes)
    transform = ShortestPaths(max_distance=max_distance)
    key_inputs = {
        "file_sha256": file_sha256(path),
        "smiles_column": smiles_column,
        "target": target,
        "split_column": split_column,
        "split": None if split_column else {"fractions": list(DEFAULT_FRACTIONS), "seed": seed},
        "sizes": None if sizes is None else list(sizes),
        "features": features,
        "transform": repr(transform),
    }
    root = cache_root(cache_dir)
    entry = root / f"file-{cache_key(key_inputs)}"
    payload = None if rebuild else load_entry(entry)
    if payload is None:
        started = time.perf_counter()
        rows, _ = read_molecule_table(path, smiles_column, [target], split_column)
        picked = assign_splits(rows, split_column, seed)
        splits, reasons = {}, {}
        for index, split in enumerate(SPLITS):
            chosen = picked[split] if sizes is None else picked[split][: sizes[index]]
            graphs, why = featurize_rows(
                [rows[i] for i in chosen],
                target,
                features,
                transform,
                progress,
                f"{path.name} {split}",
            )
            splits[split] = GraphSplit.from_graphs(graphs)
            for reason, lines in why.items():
                reasons.setdefault(reason, []).extend(lines)
        reasons = {reason: sorted(lines) for reason, lines in reasons.items()}
        info = {
            "file": path.name,
            "source_rows": len(rows),
            "skipped": {"count": sum(map(len, reasons.values())), "reasons": reasons},
            "build_seconds": round(time.perf_counter() - started, 2),
            "sizes": {split: len(splits[split]) for split in SPLITS},
            "target_stats": {split: _stats(splits[split]) for split in SPLITS},
            "key_inputs": key_inputs,
        }
        payload = {"splits": {s: splits[s].to_storage() for s in SPLITS}, "info": info}
        save_entry(entry, payload, info)
    splits = {s: GraphSplit.from_storage(payload["splits"][s]) for s in SPLITS}
    return MoleculeDataset(
        name=f"csv:{path.name}"
        if not path.name.endswith((".sdf", ".sdf.gz"))
        else f"sdf:{path.name}",
        target=target,
        unit=f"units of {target!r}",
        features=features,
        feature_spec=FEATURIZATIONS[features],
        info={**payload["info"], "path": str(path)},
        path=entry,
        **splits,
    )
