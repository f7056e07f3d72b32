"""The molecule cache: reused when intact, rebuilt when missing, corrupt or unsafe, and never
unpickles code."""

import dataclasses
import json
import pathlib

import pytest
import rdkit  # noqa: F401  (an extra `make test` installs: missing, it fails here)
import torch
import torch_geometric  # noqa: F401  (an extra `make test` installs: missing, it fails here)

from urpe.data.molecules import MOLECULE_DATASETS, cache_root, load_molecules
from urpe.data.molecules.cache import DATA_FILE, MANIFEST, _sha256

SIZES = (30, 5, 5)


class Payload:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture
def counted_builds(monkeypatch):
    """Counts how often moses-plogp is built."""
    source = MOLECULE_DATASETS["moses-plogp"]
    calls = []

    def build(request, progress):
        calls.append(request)
        return source.build(request, progress)

    monkeypatch.setitem(MOLECULE_DATASETS, "moses-plogp", dataclasses.replace(source, build=build))
    return calls


def load(cache_dir):
    return load_molecules("moses-plogp", sizes=SIZES, cache_dir=cache_dir, progress=False)


def test_cache_is_reused_and_keyed_by_the_inputs(tmp_path, counted_builds):
    first = load(tmp_path)
    second = load(tmp_path)
    assert len(counted_builds) == 1 and first.path == second.path
    assert first.path.parent == cache_root(tmp_path)
    assert torch.equal(first.train._data.spd, second.train._data.spd)
    load_molecules("moses-plogp", sizes=SIZES, max_distance=3, cache_dir=tmp_path, progress=False)
    load_molecules(
        "moses-plogp", sizes=SIZES, target="plogp-normalized", cache_dir=tmp_path, progress=False
    )
    assert len(counted_builds) == 3


def test_cache_dir_from_environment(tmp_path, monkeypatch, counted_builds):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "env"))
    data = load_molecules("moses-plogp", sizes=SIZES, progress=False)
    assert data.path.parent == tmp_path / "env" / "molecules"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupt_cache_is_rebuilt(tmp_path, counted_builds, damage):
    original = load(tmp_path)
    data_file, manifest = original.path / DATA_FILE, original.path / MANIFEST
    if damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:1000])
    elif damage == "flip":
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(bytes(raw))
    elif damage == "delete":
        data_file.unlink()
    else:
        manifest.write_text("{not json")
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt = load(tmp_path)
    assert len(counted_builds) == 2
    assert [rebuilt.train[i].smiles for i in range(len(rebuilt.train))] == [
        original.train[i].smiles for i in range(len(original.train))
    ]
    assert torch.equal(rebuilt.train._data.y, original.train._data.y)
    assert load(tmp_path).path == rebuilt.path and len(counted_builds) == 2


def test_cache_never_unpickles_code(tmp_path, counted_builds):
    original = load(tmp_path)
    marker = tmp_path / "code-ran"
    data_file = original.path / DATA_FILE
    torch.save({"splits": Payload(marker)}, data_file)
    # An attacker who rewrites the file can rewrite the manifest's hash as well.
    manifest = json.loads((original.path / MANIFEST).read_text())
    manifest["sha256"] = _sha256(data_file)
    (original.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt = load(tmp_path)
    assert not marker.exists()
    assert len(counted_builds) == 2 and len(rebuilt.train) == SIZES[0]
