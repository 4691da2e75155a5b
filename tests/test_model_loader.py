"""The GGUF conversion cache: the default model is converted once, then reused."""

from __future__ import annotations

import logging

from wsgi_infer.engine.model_loader import resolve_model_dir


def test_a_converted_gguf_is_reused(default_model_dir, caplog):
    files = {path: path.stat().st_mtime_ns for path in default_model_dir.iterdir()}
    assert any(path.suffix == ".safetensors" for path in files)
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.model_loader"):
        again = resolve_model_dir(None)
    assert again == default_model_dir
    assert "using converted copy" in caplog.text and "converting" not in caplog.text
    assert {path: path.stat().st_mtime_ns for path in again.iterdir()} == files  # nothing rewritten
