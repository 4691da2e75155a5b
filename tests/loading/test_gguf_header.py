"""A GGUF's header read without torch (``gguf_header``) is what transformers' fast reader reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers.integrations.gguf.reader import _read_metadata, _read_tensor_table

from wsgi_infer.engine.loading.gguf_file import tensor_table
from wsgi_infer.engine.loading.gguf_header import read_header
from wsgi_infer.engine.loading.gguf_tokenizer import STRING_ARRAYS
from wsgi_infer.engine.loading.model_paths import ModelLoadError, default_model_path, gguf_identity

from ..support.gguf_files import MIXED_TYPES, write_tiny_gguf


def transformers_header(path: Path, string_arrays=()) -> tuple[dict, list, int]:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    metadata, count, pos = _read_metadata(blob, str(path), string_arrays)
    entries, pos = _read_tensor_table(blob, count, pos)
    alignment = metadata.get("general.alignment", 32)
    return metadata, entries, (pos + alignment - 1) // alignment * alignment


@pytest.mark.parametrize("arch", [None, "llama", "qwen3", "phi3"])  # None: the shipped SmolLM2
def test_the_header_is_what_transformers_reads(tmp_path, arch):
    path = default_model_path() if arch is None else write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES, arch=arch).path
    for strings in ((), STRING_ARRAYS):  # the vocabulary by its length, then its strings
        ours = read_header(path, strings)
        assert ours == transformers_header(path, strings)
    metadata, entries, data_start = ours
    assert isinstance(metadata["tokenizer.ggml.tokens"], list) and len(entries) > 10
    assert data_start % metadata.get("general.alignment", 32) == 0 and data_start < path.stat().st_size


@pytest.mark.slow  # a fresh interpreter
def test_it_needs_no_torch(tmp_path):
    """What lets a process read a config and a tokenizer without importing torch (``text_files``)."""
    script = "import sys; sys.modules['torch'] = None; from wsgi_infer.engine.loading.gguf_header import read_header"
    check = f"{script}; print(read_header(__import__('pathlib').Path(sys.argv[1]))[0]['general.architecture'])"
    done = subprocess.run([sys.executable, "-c", check, str(default_model_path())], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "llama", done.stderr


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="does not start with the GGUF magic bytes"):
        read_header(path)
    with pytest.raises(ModelLoadError, match="does not start with the GGUF magic bytes"):  # logged with no traceback
        gguf_identity(path)  # a load's first read of the file


def test_a_file_cut_short_is_refused_as_truncated(tmp_path):
    """What a copy cut short said: "cannot reshape array of size 18214336 into shape (49152,612)", or "unpack_from
    requires a buffer of at least 1006 bytes"."""
    whole = write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES).path.read_bytes()
    _, _, data_start = read_header(tmp_path / "t.gguf")
    for cut in (data_start // 2, len(whole) - 100):
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="is truncated"):
            tensor_table(path)
