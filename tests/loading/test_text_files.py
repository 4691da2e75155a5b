"""A GGUF's text files made ahead by a process without torch (``text_files_ahead``, as a server's master starts it)
are those a conversion makes itself, and the conversion that follows takes them: the config at once, the tokenizer
once read, while the weights load."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from wsgi_infer.engine import text_side
from wsgi_infer.engine.loading import model_loader
from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir
from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.loading.resolved_config import RESOLVED_CONFIGS_DIR
from wsgi_infer.server.gunicorn.text_files_ahead import may_name_a_gguf

from ..support.fresh_imports import assert_a_load_imports_only_what_load_imports_names
from ..support.gguf_files import MIXED_TYPES, write_tiny_gguf

AHEAD = "wsgi_infer.server.gunicorn.text_files_ahead"


def files_of(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.slow  # a fresh interpreter reads the file
@pytest.mark.parametrize("arch", [None, "phi3"])  # the shipped SmolLM2; Phi-3 reads LongRoPE's factors from tensors
def test_text_files_made_ahead_without_torch_are_the_conversions_own(tmp_path, monkeypatch, caplog, arch):
    gguf = default_model_path() if arch is None else write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES, arch=arch).path
    ahead, inline = tmp_path / "ahead", tmp_path / "inline"
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(ahead), "WSGI_INFER_MODEL": str(gguf)}
    done = subprocess.run([sys.executable, "-m", AHEAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "read ahead of its conversion" in done.stderr, done.stderr  # torch is blocked there
    converted = {}
    for cache in (ahead, inline):
        monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(cache))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=model_loader.__name__):
            converted[cache] = resolve_model_dir(gguf)
        assert ("config read ahead" in caplog.text) == ("tokenizer read ahead" in caplog.text) == (cache == ahead)
    assert converted[ahead].name == converted[inline].name
    assert files_of(converted[ahead]) == files_of(converted[inline])
    assert files_of(ahead / RESOLVED_CONFIGS_DIR) == files_of(inline / RESOLVED_CONFIGS_DIR)
    assert [p.name for p in ahead.iterdir() if p.name.startswith(".")] == []  # the text files were taken


HALVES = """
import sys
sys.modules["torch"] = None
from pathlib import Path
from wsgi_infer.engine.loading.text_files import read_config_ahead, read_tokenizer_ahead
gguf = Path(sys.argv[1])
lock, config = read_config_ahead(gguf)
print("config read", flush=True)
sys.stdin.readline()
read_tokenizer_ahead(gguf, lock, config)
"""


@contextmanager
def halfway_ahead(gguf, cache, monkeypatch, caplog) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A process without torch that has read the file's config ahead and waits for a line to read its tokenizer,
    and the copy a conversion committed meanwhile, without the tokenizer; the process is killed at the end."""
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(cache)}
    child = subprocess.Popen(
        [sys.executable, "-c", HALVES, str(gguf)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "config read\n"
        monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(cache))
        with caplog.at_level(logging.INFO):
            copy = resolve_model_dir(gguf)
        assert "config read ahead" in caplog.text and "tokenizer is being read ahead" in caplog.text
        assert (copy / "config.json").is_file() and not (copy / "tokenizer_config.json").exists()
        yield child, copy
    finally:
        child.kill()
        child.wait()


def assert_the_conversions_own(copy, tokenizer, gguf, inline, monkeypatch) -> None:
    """The copy's files, and its tokenizer, as a conversion with nothing made ahead makes them."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(inline))
    converted = resolve_model_dir(gguf)
    assert files_of(copy) == files_of(converted)
    text = "Hello there, 世界 <|im_end|>"
    assert tokenizer.encode(text) == load_tokenizer(converted).encode(text)


@pytest.mark.slow  # a fresh interpreter reads the file
def test_a_copy_committed_while_its_tokenizer_is_read_takes_it_at_its_first_tokenizer_load(
    tmp_path, monkeypatch, caplog
):
    gguf, ahead, inline = default_model_path(), tmp_path / "ahead", tmp_path / "inline"
    with halfway_ahead(gguf, ahead, monkeypatch, caplog) as (child, copy):
        loaded = []
        with caplog.at_level(logging.INFO):
            loader = threading.Thread(target=lambda: loaded.append(load_tokenizer(copy)))
            loader.start()
            while "waiting for its tokenizer" not in caplog.text:  # the load waits for the other process
                assert loader.is_alive(), caplog.text
                loader.join(0.01)
            assert loaded == []
            child.communicate("go\n", timeout=300)
            loader.join(300)
    assert child.returncode == 0
    assert_the_conversions_own(copy, loaded[0], gguf, inline, monkeypatch)
    assert [p.name for p in ahead.iterdir() if p.name.startswith(".")] == []  # the tokenizer files were taken


@pytest.mark.slow  # a fresh interpreter reads the file
@pytest.mark.parametrize("share, weights_first", [(text_side.TOKENIZER_SHARE, False), (1.0, True)])
def test_a_first_load_takes_its_weights_while_a_tokenizer_small_beside_them_is_read_ahead(
    tmp_path, monkeypatch, caplog, share, weights_first
):
    """The shipped model's 49,152 tokens hold about a fifth of its file's memory: its weights wait for its tokenizer
    (read first, so that its transient comes before their memory), unless the share allowed is larger."""
    monkeypatch.setattr(text_side, "TOKENIZER_SHARE", share)
    order, loaded = [], []

    def load_weights() -> str:
        order.append("weights")
        return "weights"

    with halfway_ahead(default_model_path(), tmp_path / "ahead", monkeypatch, caplog) as (child, copy):
        with caplog.at_level(logging.INFO):
            load = lambda: loaded.append(text_side.with_weights(copy, None, 49152, load_weights))  # noqa: E731
            loader = threading.Thread(target=load)
            loader.start()
            while "waiting for its tokenizer" not in caplog.text:  # the tokenizer's load waits for the other process
                assert loader.is_alive(), caplog.text
                loader.join(0.01)
            assert order == (["weights"] if weights_first else [])
            assert ("loading the weights while its tokenizer is read ahead" in caplog.text) == weights_first
            child.communicate("go\n", timeout=300)
            loader.join(300)
    assert order == ["weights"] and loaded[0][0] == "weights"
    assert loaded[0][1].tokenizer.encode("Hello") == load_tokenizer(copy).encode("Hello")


@pytest.mark.slow  # a fresh interpreter reads the file
def test_a_copy_whose_tokenizer_reader_ended_without_it_reads_it_at_its_first_tokenizer_load(
    tmp_path, monkeypatch, caplog
):
    gguf, ahead, inline = default_model_path(), tmp_path / "ahead", tmp_path / "inline"
    with halfway_ahead(gguf, ahead, monkeypatch, caplog) as (_, copy):
        pass  # the process ends there, its tokenizer not read
    with caplog.at_level(logging.INFO):
        tokenizer = load_tokenizer(copy)
    assert "reading its tokenizer into" in caplog.text
    assert_the_conversions_own(copy, tokenizer, gguf, inline, monkeypatch)


@pytest.mark.slow  # a fresh interpreter reads the file
def test_a_file_it_cannot_read_is_left_to_the_conversion_which_says_why(tmp_path, monkeypatch):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + bytes(40))  # version 0
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(tmp_path), "WSGI_INFER_MODEL": str(gguf)}
    done = subprocess.run([sys.executable, "-m", AHEAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == ""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="GGUF v0"):
        resolve_model_dir(gguf)


@pytest.mark.parametrize(
    "environ, may",
    [
        ({}, True),  # the shipped SmolLM2
        ({"WSGI_INFER_MODEL": "/models/tiny"}, False),
        ({"WSGI_INFER_MODEL": "/models/tiny.gguf"}, True),
        ({"WSGI_INFER_MODEL": "/models/tiny", "WSGI_INFER_MODELS_DIR": "/models"}, True),
        ({"WSGI_INFER_MODEL": "/models/tiny", "WSGI_INFER_MODELS": ""}, False),
    ],
)
def test_the_master_starts_it_only_where_the_settings_may_name_a_gguf(environ, may):
    assert may_name_a_gguf(environ) == may


@pytest.fixture
def processes_ahead(monkeypatch) -> list[list[str]]:
    """The processes ``start_text_files_ahead`` starts (recorded, none run) on 2 CPUs, in a ``wsgi-infer serve``
    that stops where it would import gunicorn's application (the master's imports, then its hook)."""
    from types import SimpleNamespace

    from wsgi_infer.server.gunicorn import text_files_ahead

    started = []
    monkeypatch.setattr(text_files_ahead, "_started", False)
    recorder = SimpleNamespace(Popen=lambda argv, **kwargs: started.append(argv), DEVNULL=subprocess.DEVNULL)
    monkeypatch.setattr(text_files_ahead, "subprocess", recorder)  # that module alone: other threads start theirs
    monkeypatch.setattr(text_files_ahead, "cpu_budget", lambda: SimpleNamespace(cpus=2))
    monkeypatch.setitem(sys.modules, "gunicorn.app.wsgiapp", None)
    for name in ("WSGI_INFER_MODEL", "WSGI_INFER_MODELS"):  # the command sets them: restored after
        monkeypatch.setenv(name, "")
    return started


def test_serve_starts_the_process_ahead_before_gunicorn_is_imported_and_the_masters_hook_starts_no_second(
    processes_ahead,
):
    from wsgi_infer.cli import main
    from wsgi_infer.server.gunicorn.text_files_ahead import start_text_files_ahead

    with pytest.raises(ImportError, match="gunicorn.app.wsgiapp"):
        main(["serve", "--model", "/models/tiny.gguf"])
    assert processes_ahead == [[sys.executable, "-m", AHEAD]]
    start_text_files_ahead()  # the master's hook, as gunicorn.conf.py runs it
    assert len(processes_ahead) == 1


@pytest.mark.parametrize("flags", [["--env", "WSGI_INFER_MODEL=/models/other.gguf"], ["-eWSGI_INFER_MODEL=a.gguf"]])
def test_serve_leaves_the_process_ahead_to_the_masters_hook_where_gunicorns_flags_set_variables(processes_ahead, flags):
    from wsgi_infer.cli import main
    from wsgi_infer.server.gunicorn.text_files_ahead import start_text_files_ahead

    with pytest.raises(ImportError, match="gunicorn.app.wsgiapp"):
        main(["serve", "--model", "/models/tiny.gguf", "--", *flags])
    assert processes_ahead == []  # they are set as the master reads its configuration, after this
    start_text_files_ahead()
    assert processes_ahead == [[sys.executable, "-m", AHEAD]]


@pytest.mark.slow  # a fresh interpreter loads a model
def test_a_first_start_with_its_text_files_ahead_imports_no_config_class_nor_the_index_of_models(tmp_path):
    """What the hub imports before the engine thread converts (``load_imports``) is all the conversion imports, and
    neither the architecture's config class (transformers' kernel hub, torch.distributed and sympy with it) nor
    transformers' index of every model (which its GGUF processors import) is among it: the process ahead found the
    row orders too."""
    path = write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES).path
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(tmp_path / "cache"), "WSGI_INFER_MODEL": str(path)}
    subprocess.run([sys.executable, "-m", AHEAD], env=env, check=True, timeout=300)
    heavy = ("transformers.models", "transformers.models.llama.configuration_llama", "torch.distributed.tensor")
    assert_a_load_imports_only_what_load_imports_names(path, env, absent=heavy)


LOAD_AFTER_THE_READER_ENDED = """
import importlib, sys
from wsgi_infer.engine.loading import model_loader
from wsgi_infer.engine.runtime import native_threads
gguf = sys.argv[1]
imports = model_loader.load_imports(gguf)
for module in imports:
    importlib.import_module(module)
print(" ".join(imports), flush=True)
sys.stdin.readline()  # the reader ahead ends without the tokenizer meanwhile
asked = []

def importer(function, *args):  # as the server's hub imports for its engine thread
    before = set(sys.modules)
    function(*args)
    asked.extend(set(sys.modules) - before)

native_threads.set_importer(importer)
before = set(sys.modules)
from wsgi_infer import LLM
print(len(LLM(model=gguf).generate("Hi")[0].token_ids), flush=True)
new = sorted(m for m in set(sys.modules) - before - set(asked) if m.startswith(("transformers", "gguf")))
assert not new, new
assert "transformers.integrations.gguf.gguf_tokenizer_mapping" in asked, asked
"""


@pytest.mark.slow  # fresh interpreters read the file
def test_a_first_load_whose_tokenizer_reader_ends_without_it_has_its_readers_imported_for_it(tmp_path):
    """A first start whose config was read ahead and whose tokenizer still is, at the hub's start, imports only what
    finds where the tensors lie; where the reader then ends without the tokenizer, the load reads it itself, its
    readers imported by whom the server names (its hub), not on the loading thread."""
    gguf, cache = write_tiny_gguf(tmp_path / "t.gguf", MIXED_TYPES).path, tmp_path / "cache"
    env = os.environ | {"WSGI_INFER_CACHE_DIR": str(cache)}
    started = []
    try:
        reader = subprocess.Popen([sys.executable, "-c", HALVES, str(gguf)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        started.append(reader)
        assert reader.stdout.readline() == "config read\n"  # and it holds the tokenizer's lock
        load = subprocess.Popen([sys.executable, "-c", LOAD_AFTER_THE_READER_ENDED, str(gguf)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        started.append(load)
        imported = load.stdout.readline().split()
        assert imported == [*model_loader.PREPARED_LOAD_IMPORTS, *model_loader.MADE_AHEAD_CONVERSION_IMPORTS]
        reader.kill()  # it ends without the tokenizer
        reader.wait()
        out, _ = load.communicate("go\n", timeout=300)
    finally:
        for process in started:
            process.kill()
            process.wait()
    assert load.returncode == 0 and int(out) > 0  # tokens generated
