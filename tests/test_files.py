"""Atomic writes leave files and folders with the modes a plain write would: 0666 and 0777 less
the umask (an existing file keeps its own), never the private modes of their temporary names."""

import os
import stat

import pytest

from urpe.files import atomic_directory, atomic_write_json, atomic_write_text, current_umask


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    saved = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(saved)


def test_files_and_folders_respect_the_umask(tmp_path, umask):
    assert current_umask() == umask
    atomic_write_json(tmp_path / "results.json", {"a": 1})
    atomic_write_text(tmp_path / "records" / "run.json", "{}\n")
    atomic_directory(tmp_path / "step-1", lambda d: (d / "config.json").write_text("{}"))
    assert mode(tmp_path / "results.json") == mode(tmp_path / "records" / "run.json")
    assert mode(tmp_path / "results.json") == 0o666 & ~umask
    assert mode(tmp_path / "step-1") == 0o777 & ~umask
    assert mode(tmp_path / "step-1" / "config.json") == 0o666 & ~umask


def test_a_replaced_file_keeps_its_mode(tmp_path, umask):
    path = tmp_path / "notes.md"
    path.write_text("old")
    os.chmod(path, 0o600)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and mode(path) == 0o600


def test_saved_weights_respect_the_umask(tmp_path, umask):
    import urpe
    from urpe.models import TransformerConfig, TransformerEncoder

    model = TransformerEncoder(TransformerConfig(vocab_size=10, num_layers=1, dim=8, num_heads=2))
    urpe.save_model(model, tmp_path / "model")
    assert mode(tmp_path / "model") == 0o777 & ~umask
    for name in ("model.safetensors", "config.json"):
        assert mode(tmp_path / "model" / name) == 0o666 & ~umask, name
