"""The user's own molecules: a CSV (or TSV, SMILES or SDF) file with SMILES and one or more targets.

    data = load_molecule_file("my.csv", target="solubility")            # 80/10/10, seed 0
    data = load_molecule_file("my.csv", target="y", split_column="split")  # the file's split

- Reading (`tables.py`): CSV / TSV / `;`-separated with decimal commas (`.csv`, `.tsv`, `.txt`,
  optionally `.gz`), SMILES files (`.smi`), SDF; a header row names the columns, found in any
  case (the SMILES column by default "smiles"); each target column must hold numbers. Read with
  the standard `csv` module (no pandas). Parquet is not read: save it as CSV first.
- A row whose SMILES RDKit cannot read, or whose target is empty or not a number, is skipped and
  counted; `skipped_summary(dataset)` gives the one line that says how many and on which lines.
  RDKit's own parse messages are kept off stderr.
- Split: with `split_column`, its values say train / val (or valid, validation) / test per row;
  without, one seeded permutation of the file's distinct molecules (canonical SMILES) gives
  80/10/10 of them, every row of a molecule in its molecule's split, so no test molecule is
  also trained on. `sizes` caps each split (its first rows).
- Duplicates (one molecule on several rows) are kept and counted; `duplicates_summary(dataset)`
  says how many, how many with different values, and (with a split column) how many sit in
  more than one split.
- The cache entry is keyed by the file's content (SHA-256), never by its path: an edited file is
  rebuilt, a moved or renamed one is found again.
- The file is read once: `read_molecule_file` gives its bytes and their SHA-256 together, and
  both the cache key and the table come from them (`load_molecule_file` takes either a path or
  such a `MoleculeFile`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rdkit import Chem, rdBase

from ...progress import progress_bar
from .cache import cache_key, cache_root, load_entry, save_entry
from .featurize import FEATURIZATIONS
from .featurizer import MoleculeFeaturizer
from .splits import SPLITS, GraphSplit, MoleculeDataset, target_stats
from .tables import (
    MoleculeFileError,
    MoleculeRow,
    MoleculeTable,
    finite_number,
    load_table,
    read_molecule_table,
)

__all__ = [
    "MoleculeFile",
    "MoleculeFileError",
    "MoleculeRow",
    "assign_splits",
    "duplicates_summary",
    "is_file_spec",
    "load_molecule_file",
    "read_molecule_file",
    "read_molecule_table",
    "skipped_summary",
]

FILE_KINDS = ("csv", "sdf")  # dataset spec prefixes: csv:PATH, sdf:PATH
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)
SHOWN_LINES = 5  # line numbers named in the skipped-rows summary


def is_file_spec(spec: str) -> bool:
    """Whether a dataset name is the user's file: "csv:..." or "sdf:..." (a path, or in a run's
    config "csv:sha256-<digest>")."""
    kind, sep, rest = spec.partition(":")
    return bool(sep) and kind in FILE_KINDS and bool(rest)


def parse_file_spec(spec: str) -> tuple[str, Path] | None:
    """ "csv:PATH" / "sdf:PATH" -> (kind, absolute path); None for anything else."""
    if not is_file_spec(spec):
        return None
    kind, _, rest = spec.partition(":")
    return kind, Path(rest).expanduser().resolve()


@dataclass(frozen=True)
class MoleculeFile:
    """The user's file, read once: its bytes and their SHA-256, and its tables parsed from them."""

    path: Path
    content: bytes
    sha256: str

    def table(
        self,
        smiles_column: str = "smiles",
        targets: Sequence[str] = (),
        split_column: str | None = None,
    ) -> MoleculeTable:
        """`tables.load_table` of the bytes read (the file is not opened again)."""
        return load_table(self.path, smiles_column, targets, split_column, content=self.content)


def read_molecule_file(path: str | os.PathLike) -> MoleculeFile:
    """Read the file at `path` (made absolute); MoleculeFileError when there is none."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise MoleculeFileError(f"no such file: {path}")
    content = path.read_bytes()
    return MoleculeFile(path, content, hashlib.sha256(content).hexdigest())


def molecule_keys(rows: Sequence[MoleculeRow]) -> list[str | None]:
    """Each row's canonical SMILES (one molecule, however written); None where RDKit cannot
    read it (such a row is skipped later)."""
    keys: list[str | None] = []
    with rdBase.BlockLogs():
        for row in rows:
            mol = Chem.MolFromSmiles(row.smiles) if row.smiles else None
            keys.append(None if mol is None else Chem.MolToSmiles(mol))
    return keys


def _groups(keys: Sequence[str | None]) -> list[list[int]]:
    """Row indices per distinct molecule, in order of first appearance (an unreadable row alone)."""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(("row", i) if key is None else key, []).append(i)
    return list(groups.values())


def assign_splits(
    rows: Sequence[MoleculeRow],
    keys: Sequence[str | None],
    split_column: str | None,
    seed: int,
) -> dict[str, list[int]]:
    """Row indices per split: the split column's values, else an 80/10/10 seeded permutation of
    the distinct molecules (`keys`), each molecule's rows together. A file without duplicates
    gets the permutation of its rows."""
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
    groups = _groups(keys)
    order = np.random.default_rng(seed).permutation(len(groups)).tolist()
    n_train = int(len(groups) * DEFAULT_FRACTIONS[0])
    n_val = int(len(groups) * DEFAULT_FRACTIONS[1])
    blocks = {
        "train": order[:n_train],
        "val": order[n_train : n_train + n_val],
        "test": order[n_train + n_val :],
    }
    return {split: [i for g in block for i in groups[g]] for split, block in blocks.items()}


def find_duplicates(
    rows: Sequence[MoleculeRow], keys: Sequence[str | None], target: str, split_column: str | None
) -> dict[str, Any]:
    """How many molecules sit on several rows; how many of them with different values of the
    target, or (with a split column) in more than one split; the first conflict as an example."""
    repeated = [g for g in _groups(keys) if len(g) > 1 and keys[g[0]] is not None]
    conflicting, example = 0, None
    for group in repeated:
        values = [finite_number(rows[i].targets.get(target, "")) for i in group]
        if len({v for v in values if v is not None}) > 1:
            conflicting += 1
            example = example or {
                "smiles": keys[group[0]],
                "lines": [rows[i].line for i in group],
                "values": [rows[i].targets.get(target, "") for i in group],
            }
    across = None
    if split_column is not None:
        across = sum(
            len({SPLIT_NAMES.get((rows[i].split or "").lower()) for i in g}) > 1 for g in repeated
        )
    return {
        "molecules": len(repeated),
        "rows": sum(map(len, repeated)),
        "conflicting": conflicting,
        "across_splits": across,
        "example": example,
    }


def duplicates_summary(dataset: Any) -> str | None:
    """One line on the molecules a file dataset holds on several rows, or None."""
    info = getattr(dataset, "info", None) or {}
    found = info.get("duplicates")
    if not found or not found["molecules"]:
        return None
    line = (
        f"{info.get('file', 'the file')}: {found['molecules']} molecules appear on more than "
        f"one row ({found['rows']} rows)"
    )
    if found["conflicting"]:
        example = found["example"]
        shown = ", ".join(map(str, example["lines"][:SHOWN_LINES]))
        line += (
            f"; {found['conflicting']} of them with different values of {dataset.target!r} (e.g. "
            f"{example['smiles']} on lines {shown}: {', '.join(example['values'][:SHOWN_LINES])})"
        )
    line += "; all rows kept"
    if found["across_splits"] is None:  # the seeded split: by molecule
        line += ", each molecule's rows in one split"
    elif found["across_splits"]:
        line += (
            f", but {found['across_splits']} of them in more than one split of the split column "
            "(a molecule tested on is also trained on)"
        )
    return line


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
    featurizer: MoleculeFeaturizer,
    progress: bool = False,
    description: str = "molecules",
) -> tuple[list[Any], dict[str, list[int]]]:
    """Graphs of the rows (y = the target, when given) and the lines skipped, by reason."""
    graphs, invalid, no_target = [], [], []
    with rdBase.BlockLogs():  # a skipped molecule is counted, not printed by RDKit
        for row in progress_bar(rows, desc=description, unit="molecule", enabled=progress):
            value = None
            if target is not None:
                value = finite_number(row.targets.get(target, ""))
                if value is None:
                    no_target.append(row.line)
                    continue
            parsed = featurizer.parse(row.smiles)
            if parsed is None:
                invalid.append(row.line)
                continue
            data, _ = parsed
            if value is not None:
                data.y = torch.tensor([value], dtype=torch.float32)
            data.smiles = row.smiles
            graphs.append(featurizer.relate(data))
    reasons = {"invalid SMILES": invalid}
    if target is not None:
        reasons[f"without a number in {target!r}"] = no_target
    return graphs, reasons


def load_molecule_file(
    path: str | os.PathLike | MoleculeFile,
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
) -> MoleculeDataset:
    """A `MoleculeDataset` from the user's file (see the module docstring), cached by content.

    Args:
        path: a CSV/TSV/SMILES (optionally gzipped) or SDF file, or its `read_molecule_file`.
        target: the target column, any case (numbers; its units are the file's, unnamed: the
            dataset's `unit` is ""); the dataset's `target` is the header's spelling.
        smiles_column: the SMILES column (any case; SDF files give the molecule itself).
        split_column: a column of train / val / test per row; None: a seeded 80/10/10 split.
        sizes: (train, val, test) caps; None: every row.
        seed, features, max_distance, cache_dir, progress, rebuild: as `load_molecules`.
    """
    if features not in FEATURIZATIONS:
        raise MoleculeFileError(f"features must be one of {', '.join(FEATURIZATIONS)}")
    file = path if isinstance(path, MoleculeFile) else read_molecule_file(path)
    path = file.path
    sizes = None if sizes is None else tuple(int(s) for s in sizes)
    featurizer = MoleculeFeaturizer(features, max_distance)
    key_inputs = {
        "file_sha256": file.sha256,
        "smiles_column": smiles_column,
        "target": target,
        "split_column": split_column,
        "split": None
        if split_column
        else {"fractions": list(DEFAULT_FRACTIONS), "seed": seed, "by": "molecule"},
        "sizes": None if sizes is None else list(sizes),
        "features": features,
        "transform": repr(featurizer.paths),  # as named before the featuriser: same entries
    }
    root = cache_root(cache_dir)
    entry = root / f"file-{cache_key(key_inputs)}"
    payload = None if rebuild else load_entry(entry)
    if payload is None:
        started = time.perf_counter()
        table = file.table(smiles_column, [target], split_column)
        rows, column = table.rows, table.targets[0]  # the header's own spelling from here on
        keys = molecule_keys(rows)
        picked = assign_splits(rows, keys, table.split_column, seed)
        splits, reasons = {}, {}
        for index, split in enumerate(SPLITS):
            chosen = picked[split] if sizes is None else picked[split][: sizes[index]]
            graphs, why = featurize_rows(
                [rows[i] for i in chosen],
                column,
                featurizer,
                progress,
                f"{path.name} {split}",
            )
            splits[split] = GraphSplit.from_graphs(graphs)
            for reason, lines in why.items():
                reasons.setdefault(reason, []).extend(lines)
        reasons = {reason: sorted(lines) for reason, lines in reasons.items()}
        info = {
            "file": path.name,
            "target": column,
            "source_rows": len(rows),
            "skipped": {"count": sum(map(len, reasons.values())), "reasons": reasons},
            "duplicates": find_duplicates(rows, keys, column, table.split_column),
            "build_seconds": round(time.perf_counter() - started, 2),
            "sizes": {split: len(splits[split]) for split in SPLITS},
            "target_stats": {split: target_stats(splits[split]) for split in SPLITS},
            "key_inputs": key_inputs,
        }
        payload = {"splits": {s: splits[s].to_storage() for s in SPLITS}, "info": info}
        save_entry(entry, payload, info)
    splits = {s: GraphSplit.from_storage(payload["splits"][s]) for s in SPLITS}
    return MoleculeDataset(
        name=f"csv:{path.name}"
        if not path.name.endswith((".sdf", ".sdf.gz"))
        else f"sdf:{path.name}",
        target=payload["info"]["target"],
        unit="",  # the file's own units, unnamed
        featurizer=featurizer,
        # The entry is shared by files of the same content: name the file given, not the first
        # one cached under another name.
        info={**payload["info"], "file": path.name, "path": str(path)},
        path=entry,
        **splits,
    )
