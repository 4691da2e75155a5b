"""What a start finds damaged or cannot write (the loading probe): a prepared cache made read-only, a conversion a
cleaner cut down, an empty GGUF, a truncated safetensors file. Each is a clear error naming its file, or no error."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from wsgi_infer.engine.loading import model_paths
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.gguf_header import read_header
from wsgi_infer.engine.loading.model_loader import resolve_model_dir
from wsgi_infer.engine.loading.model_paths import ModelLoadError, file_digest

from ..support.gguf_files import MIXED_TYPES, write_tiny_gguf


def test_a_digest_the_cache_cannot_keep_is_taken_all_the_same(tmp_path, monkeypatch, caplog):
    """A read-only prepared cache, its file's inode or ctime changed (an image layer, a restore): the start failed
    on writing the memo, `Operation not permitted`, though the conversion it names was there to read."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")

    def read_only(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(model_paths, "write_json", read_only)
    with caplog.at_level(logging.WARNING, logger=model_paths.__name__):
        assert file_digest(path) == file_digest(path)  # taken twice: remembered by nothing
    assert "is not remembered" in caplog.text


def test_a_conversion_without_its_config_is_made_again(tmp_path, monkeypatch):
    """Every later start failed: `Directory not empty`, moving the new conversion onto what was left of the old."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES).path
    converted = resolve_model_dir(str(path))
    (converted / "config.json").unlink()
    assert resolve_model_dir(str(path)) == converted and (converted / "config.json").is_file()


def test_an_empty_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.gguf"
    path.touch()
    with pytest.raises(ValueError, match=f"{path} is empty"):  # it was "cannot mmap an empty file"
        read_header(path)


def test_a_truncated_safetensors_file_is_refused_by_name(tiny_model_dirs, tmp_path):
    """safetensors' own error named no file, and escaped `wsgi-infer generate` as a traceback."""
    model = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "cut")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"model file {weights}"):
        CheckpointTensors(model, torch.float32)
