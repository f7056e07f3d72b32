"""Molecule graph-regression datasets, real and offline, with Graphormer's shortest paths
precomputed and cached.

Each name in `MOLECULE_DATASETS` says what it is:

- `moses-plogp`: 12,000 molecules of MOSES's training SMILES (`molsets`; molecules from ZINC's
  "Clean Leads", at most ~26 heavy atoms), split 10,000 / 1,000 / 1,000, target penalised logP
  computed with RDKit. A ZINC-*derived* substitute for the ZINC benchmark, not ZINC: other
  molecules, and a target sd of about 1.1 where ZINC-12k's (standardised) target has about 2.0.
- `qm9`: all 130,831 QM9 molecules from `qm9pack`'s CSVs, target the HOMO-LUMO gap (eV) by
  default or any other by name; a seeded random split 110,000 / 10,000 / 10,831, the sizes
  SchNet and DimeNet use (not their exact molecules).
- `zinc`, `zinc-full`: the real ZINC benchmark (12k subset, 10,000 / 1,000 / 1,000; full,
  220,011 / 24,445 / 5,000) through `torch_geometric.datasets.ZINC`, from PyG's raw files that
  the user already has (`zinc_dir` or $URPE_ZINC_DIR); nothing is downloaded. Target: ZINC's
  standardised penalised logP.

Splits are blocks of one seeded permutation: train, then val, then test. `sizes` caps each block
(its first molecules), so a small CPU run uses a subset of the standard split. A molecule RDKit
cannot featurise is dropped (counted in `info["dropped"]`; none in MOSES or QM9 as shipped).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rdkit import RDLogger
from torch_geometric.data import Data

from ...progress import progress_bar
from . import sources
from .cache import cache_key, cache_root, load_entry, save_entry
from .featurize import FEATURIZATIONS
from .featurizer import MoleculeFeaturizer
from .files import is_file_spec, load_molecule_file, parse_file_spec
from .splits import SPLITS, GraphSplit, MoleculeDataset, target_stats
from .targets import PLOGP_TARGETS


@dataclass(frozen=True)
class _Request:
    target: str
    sizes: tuple[int, int, int]
    seed: int
    featurizer: MoleculeFeaturizer
    zinc_dir: str | None
    scratch: Path  # where a build may write temporary files (not part of the cache key)


@dataclass(frozen=True)
class MoleculeSource:
    """A dataset name: what it is, its targets and standard split, and how to build it."""

    description: str
    targets: tuple[str, ...]
    default_target: str
    standard_sizes: tuple[int, int, int]
    identity: Callable[[_Request], dict[str, Any]]
    build: Callable[[_Request, bool], tuple[dict[str, list[Data]], dict[str, Any]]]
    features: tuple[str, ...] = tuple(FEATURIZATIONS)


# --- shared helpers ----------------------------------------------------------------------------


def _blocks(order: np.ndarray, standard: Sequence[int], sizes: Sequence[int]) -> list[np.ndarray]:
    """Train, val, test: consecutive blocks of `order` with the standard sizes, each cut to
    `sizes`."""
    starts = np.cumsum([0, *standard])
    return [order[starts[i] : starts[i] + sizes[i]] for i in range(3)]


def _graphs(
    records: Sequence[tuple[str, float | None]],
    request: _Request,
    target_fn: Callable | None,
    description: str,
    progress: bool,
) -> tuple[list[Data], int]:
    """Featurise SMILES (with the target given or computed from the molecule) and add the
    relation. Returns the graphs and how many molecules were dropped."""
    RDLogger.DisableLog("rdApp.*")  # a dropped molecule is counted, not printed
    graphs, dropped = [], 0
    for smiles, value in progress_bar(records, desc=description, unit="molecule", enabled=progress):
        parsed = request.featurizer.parse(smiles)
        if parsed is None:
            dropped += 1
            continue
        data, mol = parsed
        if target_fn is not None:
            value = target_fn(mol)
        if value is None or not math.isfinite(value):
            dropped += 1
            continue
        data.y = torch.tensor([value], dtype=torch.float32)
        data.smiles = smiles
        graphs.append(request.featurizer.relate(data))
    return graphs, dropped


# --- moses-plogp -------------------------------------------------------------------------------


def _moses_identity(request: _Request) -> dict[str, Any]:
    return {
        "file": sources.file_identity(sources.moses_file("train")),
        "molsets": sources.package_version("molsets"),
    }


def _moses_build(request: _Request, progress: bool):
    smiles = sources.read_moses_smiles(sources.moses_file("train"))
    order = np.random.default_rng(request.seed).permutation(len(smiles))
    blocks = _blocks(order, MOLECULE_DATASETS["moses-plogp"].standard_sizes, request.sizes)
    target_fn = PLOGP_TARGETS[request.target]
    splits, dropped = {}, {}
    for split, rows in zip(SPLITS, blocks, strict=True):
        records = [(smiles[i], None) for i in rows]
        splits[split], dropped[split] = _graphs(
            records, request, target_fn, f"moses-plogp {split}", progress
        )
    return splits, {"dropped": dropped, "source_molecules": len(smiles)}


# --- qm9 ---------------------------------------------------------------------------------------


def _qm9_identity(request: _Request) -> dict[str, Any]:
    return {
        "files": [sources.file_identity(p) for p in sources.qm9_files()],
        "qm9pack": sources.package_version("qm9pack"),
    }


def _qm9_build(request: _Request, progress: bool):
    rows = list(sources.iter_qm9_rows(sources.qm9_files(), request.target))
    order = np.random.default_rng(request.seed).permutation(len(rows))
    standard = (110_000, 10_000, max(len(rows) - 120_000, 0))
    blocks = _blocks(order, standard, request.sizes)
    splits, dropped = {}, {}
    for split, picked in zip(SPLITS, blocks, strict=True):
        splits[split], dropped[split] = _graphs(
            [rows[i] for i in picked], request, None, f"qm9 {split}", progress
        )
    return splits, {"dropped": dropped, "source_molecules": len(rows)}


# --- zinc --------------------------------------------------------------------------------------


def _zinc_identity(subset: bool) -> Callable[[_Request], dict[str, Any]]:
    def identity(request: _Request) -> dict[str, Any]:
        raw = sources.zinc_raw_dir(request.zinc_dir, subset)
        names = sources.ZINC_PICKLES + (sources.ZINC_INDEXES if subset else ())
        return {"files": [sources.file_identity(raw / n) for n in names], "subset": subset}

    return identity


def _zinc_build(subset: bool):
    def build(request: _Request, progress: bool):
        from torch_geometric.datasets import ZINC

        raw = sources.zinc_raw_dir(request.zinc_dir, subset)
        # PyG processes into <root>/{subset,full}/processed; keep that out of the user's folder
        # with a scratch root whose raw/ links to their files.
        request.scratch.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".zinc-scratch-", dir=request.scratch))
        scratch_raw = scratch / "raw"
        scratch_raw.mkdir()
        try:
            for name in sources.ZINC_PICKLES + sources.ZINC_INDEXES:
                if (raw / name).is_file():
                    (scratch_raw / name).symlink_to((raw / name).resolve())
                else:  # the full set never reads the .index files, but PyG wants them present
                    (scratch_raw / name).write_text("")
            splits, counts = {}, {}
            for split, cap in zip(SPLITS, request.sizes, strict=True):
                with warnings.catch_warnings():
                    # PyG's loader retries with full unpickling when the safe load fails and
                    # says so in a warning; make that warning an error so it never does.
                    warnings.filterwarnings("error", message=".*[Ww]eights only load failed.*")
                    try:
                        zinc = ZINC(str(scratch), subset=subset, split=split)
                    except UserWarning as refusal:
                        raise RuntimeError(
                            f"refusing to unpickle PyG's processed ZINC file: {refusal}"
                        ) from refusal
                counts[split] = len(zinc)
                graphs = []
                for i in progress_bar(
                    range(min(cap, len(zinc))),
                    desc=f"zinc {split}",
                    unit="molecule",
                    enabled=progress,
                ):
                    data = zinc[i]
                    data = Data(
                        x=data.x.long().view(-1, 1),  # (N, 1) ZINC atom type
                        edge_index=data.edge_index,
                        edge_attr=data.edge_attr.long().view(-1, 1),  # (E, 1) bond type
                        y=data.y.float().view(1),
                    )
                    graphs.append(request.featurizer.relate(data))
                splits[split] = graphs
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return splits, {"dropped": dict.fromkeys(SPLITS, 0), "source_sizes": counts}

    return build


MOLECULE_DATASETS: dict[str, MoleculeSource] = {
    "moses-plogp": MoleculeSource(
        description="MOSES SMILES (ZINC-derived, not ZINC), penalised logP by RDKit",
        targets=tuple(PLOGP_TARGETS),
        default_target="plogp",
        standard_sizes=(10_000, 1_000, 1_000),
        identity=_moses_identity,
        build=_moses_build,
    ),
    "qm9": MoleculeSource(
        description="QM9 (qm9pack), a quantum-chemical property, HOMO-LUMO gap by default",
        targets=tuple(sources.QM9_TARGETS) + sources.QM9_COLUMNS,
        default_target="gap",
        standard_sizes=(110_000, 10_000, sources.QM9_TOTAL - 120_000),
        identity=_qm9_identity,
        build=_qm9_build,
    ),
    "zinc": MoleculeSource(
        description="ZINC 12k subset from local PyG raw files, standardised penalised logP",
        targets=("plogp-normalized",),
        default_target="plogp-normalized",
        standard_sizes=(10_000, 1_000, 1_000),
        identity=_zinc_identity(True),
        build=_zinc_build(True),
        features=("zinc",),
    ),
    "zinc-full": MoleculeSource(
        description="ZINC full (250k) from local PyG raw files, standardised penalised logP",
        targets=("plogp-normalized",),
        default_target="plogp-normalized",
        standard_sizes=(220_011, 24_445, 5_000),
        identity=_zinc_identity(False),
        build=_zinc_build(False),
        features=("zinc",),
    ),
}


def molecule_unit(name: str, target: str) -> str:
    """The unit of a dataset's target; "" for a user's file (its own, unnamed)."""
    if is_file_spec(name):
        return ""
    if name == "qm9":
        return sources.QM9_TARGETS[target][2] if target in sources.QM9_TARGETS else "CSV units"
    return "logP units" if target == "plogp" else "standardised"


def load_molecules(
    name: str,
    *,
    target: str | None = None,
    sizes: Sequence[int] | None = None,
    seed: int = 0,
    features: str = "zinc",
    max_distance: int | None = None,
    shortest_paths: bool = True,
    zinc_dir: str | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    rebuild: bool = False,
    **file_options: Any,
) -> MoleculeDataset:
    """Load (building and caching on first use) a molecule dataset by name.

    Args:
        name: one of `MOLECULE_DATASETS` (moses-plogp, qm9, zinc, zinc-full), or the user's
            file as "csv:PATH" / "sdf:PATH" (see `files.load_molecule_file`, which takes
            `smiles_column` and `split_column` through `file_options`).
        target: the regression target; None takes the dataset's default. moses-plogp: "plogp"
            (logP - SA - ring penalty) or "plogp-normalized" (ZINC's standardised scale); qm9:
            "gap", "homo", "lumo", "mu", "alpha", ... or a raw CSV column.
        sizes: (train, val, test) caps, each at most the standard split's size; None = standard.
        seed: the permutation behind the split (ZINC's splits are fixed and ignore it).
        features: "zinc" (atom and bond type, as ZINC) or "rdkit" (PyG's richer RDKit features).
        max_distance: passed to `ShortestPaths` (distances above it stored as FAR).
        shortest_paths: apply `urpe.graph.ShortestPaths` before caching (Graphormer needs it).
        zinc_dir: the folder with PyG's raw ZINC files (else $URPE_ZINC_DIR).
        cache_dir: cache root (else $URPE_CACHE_DIR, else ~/.cache/urpe).
        progress: progress bars while building (lines in a log).
        rebuild: ignore an existing cache entry.
    """
    file_spec = parse_file_spec(name)
    if file_spec is not None:
        if target is None:
            raise ValueError(f"{name}: say which column is the target (target=...)")
        return load_molecule_file(
            file_spec[1],
            target=target,
            sizes=sizes,
            seed=seed,
            features=features,
            max_distance=max_distance,
            cache_dir=cache_dir,
            progress=progress,
            rebuild=rebuild,
            **file_options,
        )
    if name not in MOLECULE_DATASETS:
        raise ValueError(
            f"unknown molecule dataset {name!r}; choose one of {', '.join(MOLECULE_DATASETS)}"
        )
    source = MOLECULE_DATASETS[name]
    target = source.default_target if target is None else target
    if name != "qm9" and target not in source.targets:
        raise ValueError(f"{name} has targets {', '.join(source.targets)}; got {target!r}")
    if name == "qm9":
        sources.qm9_target_column(target, list(sources.QM9_COLUMNS))  # a clear error early
    if features not in source.features:
        raise ValueError(f"{name} offers features {', '.join(source.features)}; got {features!r}")
    standard = source.standard_sizes
    sizes = tuple(standard) if sizes is None else tuple(int(s) for s in sizes)
    if len(sizes) != 3 or any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be three counts >= 0 (train, val, test), got {sizes}")
    too_big = [f"{s} {n} > {m}" for s, n, m in zip(sizes, SPLITS, standard, strict=True) if s > m]
    if too_big:
        raise ValueError(f"{name}'s standard split is {standard}; sizes cap it: {too_big}")
    featurizer = MoleculeFeaturizer(features, max_distance, shortest_paths)
    root = cache_root(cache_dir)
    request = _Request(target, sizes, seed, featurizer, zinc_dir, root)

    key_inputs = {
        "name": name,
        "target": target,
        "sizes": list(sizes),
        "seed": seed if not name.startswith("zinc") else None,
        "features": features,
        "transform": repr(featurizer.paths),  # as named before the featuriser: same entries
        "source": source.identity(request),
    }
    entry = root / f"{name}-{cache_key(key_inputs)}"
    payload = None if rebuild else load_entry(entry)
    if payload is None:
        started = time.perf_counter()
        graphs, info = source.build(request, progress)
        splits = {split: GraphSplit.from_graphs(graphs[split]) for split in SPLITS}
        info.update(
            build_seconds=round(time.perf_counter() - started, 2),
            sizes={split: len(splits[split]) for split in SPLITS},
            target_stats={split: target_stats(splits[split]) for split in SPLITS},
            key_inputs=key_inputs,
        )
        payload = {"splits": {s: splits[s].to_storage() for s in SPLITS}, "info": info}
        save_entry(entry, payload, info)
    splits = {s: GraphSplit.from_storage(payload["splits"][s]) for s in SPLITS}
    return MoleculeDataset(
        name=name,
        target=target,
        unit=molecule_unit(name, target),
        featurizer=featurizer,
        info=payload["info"],
        path=entry,
        **splits,
    )
