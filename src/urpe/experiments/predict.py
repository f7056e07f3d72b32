"""`urpe predict RUN INPUT...`: a trained graph model's predictions for new molecules.

RUN is a sweep folder of `urpe reproduce graph` (its best run by validation MAE), a run folder
(`OUT/runs/<id>`), a checkpoint, or a folder written by `urpe.save_model`. INPUT is a CSV/TSV
(`;` and decimal commas too), SMILES (.smi) or SDF file of molecules (its SMILES column chosen
with --smiles-column), or SMILES given on the command line. The output is a CSV on stdout or in
--output (a folder gets predictions.csv inside; missing folders are created): `smiles`, then
every other column of the input files as it was (IDs, names, notes), then `predicted_<target>`
in the target's units; or JSON with --json. A SMILES RDKit cannot read gets an empty prediction
and is counted in one line on stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from ..cli_types import UsageError, existing_file, output_file, positive_int

PROG = "urpe predict"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[1].replace("\n", " ")
    parser.add_argument(
        "run",
        type=Path,
        metavar="RUN",
        help="a sweep folder (its best run), a run folder (runs/<id>), or a "
        "checkpoint of a graph model",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a CSV/TSV/SMILES/SDF file of molecules (its other columns are kept in the "
        "output), or SMILES strings",
    )
    parser.add_argument(
        "--smiles-column",
        default="smiles",
        metavar="NAME",
        help="SMILES column of an input file, any case (default: %(default)s)",
    )
    parser.add_argument(
        "--output",
        "-o",
        type=str,  # a trailing "/" (a folder) kept
        default=None,
        metavar="FILE",
        help="write the CSV (or JSON) here instead of stdout; a folder (or a path ending in /) "
        "gets predictions.csv (predictions.json) inside; missing folders are created",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="JSON instead of CSV: {target, unit, predictions: [{smiles, value, columns}], "
        "skipped}",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=256,
        help="molecules per forward pass (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_smiles(inputs: list[str], smiles_column: str) -> list[tuple[str, str, dict[str, str]]]:
    """(where, SMILES, the row's other columns) for every molecule: files read row by row, other
    inputs taken as SMILES."""
    from ..data.molecules.tables import MoleculeFileError, load_table

    out = []
    for item in inputs:
        path = existing_file(item)  # a long SMILES is no file name: never an OSError
        if path is not None:
            try:
                table = load_table(path, smiles_column)
            except MoleculeFileError as error:
                flag = "--smiles-column" if error.setting == "smiles_column" else "INPUT"
                raise UsageError(flag, str(error)) from None
            out.extend(
                (
                    f"{path.name}:{row.line}",
                    row.smiles,
                    {k: v for k, v in row.cells.items() if k != table.smiles_column},
                )
                for row in table.rows
            )
        elif any(sep in item for sep in "/\\") and item.lower().endswith((".csv", ".sdf", ".tsv")):
            raise UsageError("INPUT", f"no such file: {Path(item).expanduser()}")
        else:
            out.append((f"argument {len(out) + 1}", item.strip(), {}))
    return out


def run(args: argparse.Namespace) -> int:
    from .trained import find_trained

    say = lambda line: print(f"{PROG}: {line}", file=sys.stderr)  # noqa: E731
    if args.output is not None:  # checked before any work
        args.output = output_file(args.output, f"predictions.{'json' if args.json else 'csv'}")
    trained = find_trained(args.run, "graph", say)  # its first line comes before torch's import
    from ..training.bundles import MoleculeModel

    model = trained.model
    if not isinstance(model, MoleculeModel):
        raise UsageError(
            "RUN",
            f"{trained.checkpoint} holds a {type(model).__name__}, not a "
            "model of molecules; predict needs a graph run",
        )
    molecules = read_smiles(args.inputs, args.smiles_column)
    if not molecules:
        raise UsageError("INPUT", "no molecules to predict")
    values = model.predict(
        [s for _, s, _ in molecules], batch_size=args.batch_size, progress=not args.no_progress
    )
    skipped = [where for (where, _, _), v in zip(molecules, values, strict=True) if v is None]
    if skipped:
        shown = ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        say(f"{len(skipped)} of {len(molecules)} SMILES could not be read, left empty: {shown}")
    column = f"predicted_{model.target}"
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
    kept = list(
        dict.fromkeys(k for _, _, cells in molecules for k in cells if k not in ("smiles", column))
    )
    handle = sys.stdout if args.output is None else open(args.output, "w", newline="")
    try:
        if args.json:
            json.dump(
                {
                    "target": model.target,
                    "unit": model.unit,
                    "predictions": [
                        {"smiles": s, "value": v, **({"columns": cells} if cells else {})}
                        for (_, s, cells), v in zip(molecules, values, strict=True)
                    ],
                    "skipped": len(skipped),
                },
                handle,
                indent=1,
            )
            handle.write("\n")
        else:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(["smiles", *kept, column])
            for (_, smiles, cells), value in zip(molecules, values, strict=True):
                shown = "" if value is None else f"{value:.6g}"
                writer.writerow([smiles, *(cells.get(k, "") for k in kept), shown])
    finally:
        if handle is not sys.stdout:
            handle.close()
    if args.output is not None:
        say(f"wrote {len(molecules)} predictions of {model.quantity} to {args.output}")
    return 0
