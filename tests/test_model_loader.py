"""The GGUF conversion: as transformers reads the file, done once, then reused."""

from __future__ import annotations

import logging

from transformers import AutoConfig, AutoTokenizer

from wsgi_infer.engine.gguf_checkpoint import read_gguf_config
from wsgi_infer.engine.model_loader import default_model_path, resolve_model_dir


def test_a_converted_gguf_is_reused(default_model_dir, caplog):
    files = {path: path.stat().st_mtime_ns for path in default_model_dir.iterdir()}
    assert any(path.suffix == ".safetensors" for path in files)
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.model_loader"):
        again = resolve_model_dir(None)
    assert again == default_model_dir
    assert "using converted copy" in caplog.text and "converting" not in caplog.text
    assert {path: path.stat().st_mtime_ns for path in again.iterdir()} == files  # nothing rewritten


def test_a_gguf_is_converted_as_transformers_reads_it(tmp_path):
    """Our single-pass conversion writes the config and tokenizer that transformers' own GGUF
    loading gives (the weights are compared in test_quantization)."""
    gguf = default_model_path()
    ours = read_gguf_config(gguf).to_dict()
    reference = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).to_dict()
    assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {
        k: v for k, v in reference.items() if k != "_name_or_path"
    }
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(tmp_path)
    converted = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (converted / name).read_bytes() == (tmp_path / name).read_bytes(), name
