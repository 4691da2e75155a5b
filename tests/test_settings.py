"""Settings come from WSGI_INFER_* variables, and docs/operations.md documents every one."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsgi_infer.server.settings import ServerSettings

OPERATIONS = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()


def test_every_setting_is_in_the_operations_table():
    for name in ServerSettings.model_fields:
        assert f"| `WSGI_INFER_{name.upper()}` |" in OPERATIONS, name


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("WSGI_INFER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("WSGI_INFER_KV_CACHE_MEMORY_MB", "64")
    monkeypatch.setenv("WSGI_INFER_QUANTIZATION", "int8")
    config = ServerSettings().engine_config()
    assert config.max_num_seqs == 7
    assert config.kv_cache_memory_bytes == 64 << 20
    assert config.quantization == "int8"


def test_the_engine_settings_are_engine_config_fields_declared_once():
    """Generated from EngineConfig: the same names, defaults and bounds; a new engine option is a setting at once."""
    from dataclasses import fields

    from wsgi_infer.engine.config import EngineConfig

    engine = {f.name: f for f in fields(EngineConfig) if "help" in f.metadata}
    assert {"model", "quantization", "max_num_seqs", "max_model_len", "seed"} <= set(engine)
    for name, f in engine.items():
        setting = ServerSettings.model_fields[name]
        assert (setting.default, setting.description) == (f.default, f.metadata["help"]), name
    assert ServerSettings().engine_config() == EngineConfig()
    with pytest.raises(ValueError, match="max_num_seqs"):  # the bound, from the same declaration
        ServerSettings(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
