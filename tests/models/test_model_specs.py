"""Which models a server serves, from its settings: one as before, several by path, a directory, a TOML file; the
names, aliases, per-model settings and preloads, and the mistakes said at start (the fast tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsgi_infer.server.model_specs import ModelsConfigError, model_specs
from wsgi_infer.server.settings import ServerSettings


def specs(tmp_path: Path, toml: str | None = None, **settings):
    if toml is not None:
        (tmp_path / "models.toml").write_text(toml)
        settings["models_config"] = str(tmp_path / "models.toml")
    return model_specs(ServerSettings(**settings))


def fake_models(tmp_path: Path) -> tuple[Path, Path]:
    """A GGUF file and a Hugging Face directory (only their names and shapes are read here)."""
    gguf = tmp_path / "chat-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "all-MiniLM-L6-v2"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    return gguf, hf


def test_one_model_is_served_as_before(tmp_path):
    (spec,) = specs(tmp_path, model=str(tmp_path / "Qwen3-0.6B"))
    assert (spec.name, spec.path, spec.preload) == ("Qwen3-0.6B", str(tmp_path / "Qwen3-0.6B"), True)
    (named,) = specs(tmp_path, model=str(tmp_path / "m.gguf"), served_model_name="chat")
    assert named.name == "chat"
    (default,) = specs(tmp_path)
    assert default.path is None and default.name.startswith("SmolLM2")  # the embedded model


def test_several_paths_a_directory_and_their_order(tmp_path):
    gguf, hf = fake_models(tmp_path)
    listed = specs(tmp_path, model=str(hf), models=f"{gguf}, {tmp_path / 'third.gguf'}")
    assert [s.name for s in listed] == ["all-MiniLM-L6-v2", "chat-Q4_K_M", "third"]
    assert [s.preload for s in listed] == [True, False, False]  # the default model loads at start
    (tmp_path / "notes.txt").write_text("not a model")
    from_dir = specs(tmp_path, models_dir=str(tmp_path), preload="*")
    assert [s.name for s in from_dir] == ["all-MiniLM-L6-v2", "chat-Q4_K_M"] and all(s.preload for s in from_dir)


def test_a_toml_file_names_adds_and_sets_models(tmp_path):
    gguf, hf = fake_models(tmp_path)
    toml = f"""
[models.chat]
path = "{gguf}"
aliases = ["gpt-4o-mini", "default"]
kv_cache_memory_mb = 64
max_model_len = 1024
speculative = "none"

[models.embed]
path = "{hf}"
embedding_pooling = "last"
preload = true
"""
    assert [spec.name for spec in specs(tmp_path, toml)] == ["chat", "embed"]  # the file alone names the models
    chat, embed = specs(tmp_path, toml, model=str(gguf), kv_cache_memory_mb=256, max_num_seqs=8)
    assert (chat.name, chat.aliases) == ("chat", ("gpt-4o-mini", "default"))
    assert (chat.preload, embed.preload) == (False, True)  # a preload list replaces the default (the first model)
    assert (chat.settings.kv_cache_memory_mb, chat.settings.max_model_len, chat.settings.speculative) == (
        64,
        1024,
        "none",
    )
    assert chat.settings.max_num_seqs == 8  # the global setting, where the model has none of its own
    assert (embed.path, embed.settings.embedding_pooling, embed.settings.kv_cache_memory_mb) == (str(hf), "last", 256)
    assert chat.settings.engine_config().kv_cache_memory_bytes == 64 << 20
    assert embed.settings.engine_config().model == str(hf)


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ('[models.x]\npath = "a.gguf"\ncontext = 4096\n', "unknown keys ['context']"),
        ("[models.nobody]\nmax_model_len = 64\n", "no model is named 'nobody'"),
        ('[models.x]\npath = "a.gguf"\nspeculative = "medusa"\n', "[models.x]"),
        ('[models.x]\npath = "a.gguf"\naliases = "y"\n', "aliases must be a list"),
        ('[models.x]\npath = "a.gguf"\naliases = 5\n', "aliases must be a list"),  # a TypeError's traceback
        ('[models.x]\npath = "a.gguf"\naliases = {y = 1}\n', "aliases must be a list"),  # its keys were taken
        ('[models.x]\npath = "a.gguf"\nkv_cache_memory_mb = "lots"\n', "kv_cache_memory_mb = 'lots': Input should"),
        ('[models.x]\npath = "a.gguf"\npreload = "false"\n', "preload must be true or false, got 'false'"),
        ("[models.x]\npath = 5\n", "path must be a string, got 5"),
        ('[models.x]\npath = "a.gguf"\n[models.y]\npath = "b.gguf"\naliases = ["x"]\n', "given to two models"),
        ("[server]\nport = 1\n", "only [models.NAME] tables"),
        ("[models.x\n", "models config"),
    ],
)
def test_a_mistake_in_the_configuration_is_said(tmp_path, toml, said):
    with pytest.raises(ModelsConfigError) as raised:
        specs(tmp_path, toml, model=str(tmp_path / "m.gguf"))
    assert said in str(raised.value) and "\n" not in str(raised.value)  # one line (pydantic's took four)


def test_a_served_model_name_needs_the_model_it_names(tmp_path):
    """With only a config's tables, WSGI_INFER_SERVED_MODEL_NAME renamed nothing: an IndexError's traceback."""
    with pytest.raises(ModelsConfigError, match="SERVED_MODEL_NAME names WSGI_INFER_MODEL's"):
        specs(tmp_path, '[models.x]\npath = "a.gguf"\n', served_model_name="foo")


def test_a_bad_setting_of_every_model_is_blamed_on_the_settings_not_on_a_models_config(tmp_path):
    with pytest.raises(ModelsConfigError) as raised:  # it said "models config: [models.m]" with no such file
        specs(tmp_path, model=str(tmp_path / "m.gguf"), quantization="int3")
    assert str(raised.value).startswith("the WSGI_INFER_* settings (model m): ")


def test_names_given_twice_and_unknown_preloads_are_refused(tmp_path):
    with pytest.raises(ModelsConfigError, match="given to two models") as raised:
        specs(tmp_path, model=str(tmp_path / "a" / "m.gguf"), models=str(tmp_path / "b" / "m.gguf"))
    assert str(tmp_path / "a" / "m.gguf") in str(raised.value) and str(tmp_path / "b" / "m.gguf") in str(raised.value)
    with pytest.raises(ModelsConfigError, match="not served"):
        specs(tmp_path, model=str(tmp_path / "m.gguf"), preload="other")
    with pytest.raises(ModelsConfigError, match="not a directory"):
        specs(tmp_path, models_dir=str(tmp_path / "missing"))


def test_workers_take_the_models_the_master_read_and_a_broken_edit_keeps_them(tmp_path, monkeypatch):
    """The master reads the models at start and at each SIGHUP (``on_reload``), and its workers take what it read: a
    models config broken by an edit failed every new worker, and gunicorn stopped the server."""
    from wsgi_infer.server import master_reads
    from wsgi_infer.server.model_specs import read_model_specs

    monkeypatch.setattr(master_reads, "_read", {})  # this process's own, as a master's before its first read
    config = tmp_path / "models.toml"
    config.write_text(f'[models.chat]\npath = "{tmp_path / "a.gguf"}"\n')
    settings = ServerSettings(models_config=str(config))
    inputs = settings.model_dump_json()
    read = master_reads.read_for_workers("models", inputs, lambda: read_model_specs(settings))
    config.write_text("[models.chat\n")  # broken
    with pytest.raises(ModelsConfigError):
        master_reads.read_for_workers("models", inputs, lambda: read_model_specs(settings))
    assert [spec.name for spec in model_specs(settings)] == [spec.name for spec in read] == ["chat"]
    other = ServerSettings(models_config=str(config), preload="*")  # other settings: read as they stand
    with pytest.raises(ModelsConfigError):
        model_specs(other)


def test_a_reload_that_cannot_read_the_models_keeps_them_and_the_server(tmp_path, monkeypatch):
    """SIGHUP: a models config whose aliases were 5 raised a TypeError in the master, whose main loop died with the
    server; a path that names nothing failed the new workers once the old had drained, and gunicorn stopped."""
    import logging

    from wsgi_infer.server import master_reads
    from wsgi_infer.server.gunicorn.settings_files import read_again  # not config: its import makes folders

    monkeypatch.setattr(master_reads, "_read", {})
    model, config = tmp_path / "a.gguf", tmp_path / "models.toml"
    model.write_bytes(b"GGUF")
    config.write_text(f'[models.chat]\npath = "{model}"\n')
    monkeypatch.setenv("WSGI_INFER_MODELS_CONFIG", str(config))
    master = logging.getLogger("a-master")
    read_again(master)
    for broken in (
        f'[models.chat]\npath = "{model}"\naliases = 5\n',
        f'[models.chat]\npath = "{tmp_path / "b.gguf"}"\n',
    ):
        config.write_text(broken)
        read_again(master)  # it raised, or kept the missing file for the workers
        assert [(spec.name, spec.files) for spec in model_specs(ServerSettings())] == [("chat", model)]
