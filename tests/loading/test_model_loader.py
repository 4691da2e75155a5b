"""Loading: the GGUF conversion (as transformers reads the file, done once, then reused), configs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.loading import resolved_config
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE
from wsgi_infer.engine.loading.gguf_config import read_gguf_config
from wsgi_infer.engine.loading.gguf_file import tensor_table
from wsgi_infer.engine.loading.gguf_header import file_header
from wsgi_infer.engine.loading.model_builder import PACKED_ROWS_FILE
from wsgi_infer.engine.loading.model_loader import (
    CONVERSION_IMPORTS,
    FILE_IMPORTS,
    FIRST_LOAD_IMPORTS,
    PREPARED_LOAD_IMPORTS,
    load_config,
    load_imports,
    load_tokenizer,
    resolve_model_dir,
)
from wsgi_infer.engine.loading.model_paths import (
    CONVERSION_VERSION,
    FILE_DIGESTS_FILE,
    ModelLoadError,
    default_model_path,
    file_digest,
    gguf_identity,
)
from wsgi_infer.engine.loading.resolved_config import RESOLVED_CONFIGS_DIR
from wsgi_infer.engine.runtime.cache_files import cache_root

from ..conftest import TINY_ARCHITECTURES
from ..support.fresh_imports import assert_a_load_imports_only_what_load_imports_names
from ..support.gguf_files import MIXED_TYPES, write_tiny_gguf
from ..support.server import GunicornServer
from ..support.transformers_reference import assert_tokenizer_as_transformers_reads, load_hf_model


def test_a_converted_gguf_is_reused(default_model_dir, caplog):
    files = {path: path.stat().st_mtime_ns for path in default_model_dir.iterdir()}
    assert (default_model_dir / FILE_WEIGHTS_FILE) in files
    with caplog.at_level(logging.DEBUG, logger="wsgi_infer.engine.loading.model_loader"):
        again = resolve_model_dir(None)
    assert again == default_model_dir
    assert "using converted copy" in caplog.text and "reading its config and tokenizer" not in caplog.text
    assert {path: path.stat().st_mtime_ns for path in again.iterdir()} == files  # nothing rewritten


@pytest.mark.slow  # converts the default model's GGUF
def test_a_gguf_is_converted_as_transformers_reads_it(tmp_path):
    """Our single-pass conversion writes the config and tokenizer that transformers' own GGUF
    loading gives (the weights are compared in test_quantization; Gemma 3's tokenizer in test_gemma3_270m)."""
    gguf = default_model_path()
    ours = read_gguf_config(gguf).to_dict()
    reference = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).to_dict()
    assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {
        k: v for k, v in reference.items() if k != "_name_or_path"
    }
    assert_tokenizer_as_transformers_reads(gguf, resolve_model_dir(None), tmp_path)


@pytest.mark.slow  # transformers' GGUF loading reads the reference
def test_a_vocabularys_user_defined_tokens_are_read_from_its_tokenizer_json_alone(tmp_path, monkeypatch):
    """Listed in tokenizer_config.json, every load deep-copied each of them: 2 s of a start for 102,784 (the Qwen3
    shape's). Only the special ones are listed; the tokenizer still has every one, as transformers reads the file."""
    tiny = write_tiny_gguf(tmp_path / "extra.gguf", "Q8_0", user_defined_tokens=2000)
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    converted = resolve_model_dir(tiny.path)
    assert_tokenizer_as_transformers_reads(tiny.path, converted, tmp_path / "saved")
    listed = json.loads((converted / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert listed and not any(token["content"].startswith("<extra_") for token in listed.values())
    tokenizer = load_tokenizer(converted)
    assert tokenizer.encode("a<extra_1999>b")[1] == len(tokenizer) - 1


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_a_config_is_resolved_by_its_class_once_then_read_back_whole(arch, tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    reference = AutoConfig.from_pretrained(tiny_model_dirs[arch], local_files_only=True)
    first = load_config(tiny_model_dirs[arch])
    monkeypatch.setattr(resolved_config, "resolve_config", lambda model_dir: pytest.fail("resolved again"))
    again = load_config(tiny_model_dirs[arch])  # read back from the file the first wrote
    assert len(list((tmp_path / RESOLVED_CONFIGS_DIR).iterdir())) == 1
    # Every value, aliases (n_embd) included; but use_cache, a generation setting the plain config drops.
    for name in [*reference.to_dict().keys() - {"use_cache"}, *reference.attribute_map]:
        assert getattr(first, name) == getattr(again, name) == getattr(reference, name), name


@pytest.mark.slow  # a fresh interpreter loads the default model
def test_a_later_start_imports_only_the_modules_load_imports_names(default_model_dir, tmp_path, monkeypatch):
    """The server's hub imports them before the engine thread loads (importing creates loggers, which that thread
    must not). A later start needs no auto class and no architecture's config class (which brings transformers'
    kernel hub, torch.distributed and dynamo: 1.3 s and 80 MB), nor transformers' GGUF module (0.8 s: the rows'
    order is recorded); it reads the weights' blocks from the GGUF (gguf-py's type table: 0.03 s); a first load
    needs the auto classes."""
    load_config(default_model_dir)  # the first start resolves the config (and imports its class) once
    code = (
        "import importlib, sys\n"
        "from wsgi_infer.engine.loading.model_loader import FILE_IMPORTS, PREPARED_LOAD_IMPORTS, load_imports\n"
        "assert load_imports(None) == PREPARED_LOAD_IMPORTS + FILE_IMPORTS, load_imports(None)\n"
        "for module in load_imports(None): importlib.import_module(module)\n"
        "before = set(sys.modules)\n"
        "from wsgi_infer import LLM; LLM()\n"
        "new = sorted(m for m in set(sys.modules) - before if m.startswith('transformers'))\n"
        "assert not new, new\n"
        "heavy = ('transformers.models.llama.configuration_llama', 'torch._dynamo', 'transformers.integrations.gguf')\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))  # nothing prepared: the GGUF is not even hashed
    assert load_imports(None) == PREPARED_LOAD_IMPORTS + FIRST_LOAD_IMPORTS + CONVERSION_IMPORTS
    assert load_imports(tmp_path / "missing.gguf") == PREPARED_LOAD_IMPORTS + FIRST_LOAD_IMPORTS  # the load says why


@pytest.mark.slow  # a fresh interpreter loads a model
def test_a_later_start_that_reads_weights_from_the_file_imports_what_load_imports_names(tmp_path, monkeypatch):
    """A copy reads its weights from its GGUF (an F16 embedding: its rows, at every lookup) with gguf-py at every
    start: named, so the hub imports it before the engine thread loads."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "f16.gguf", MIXED_TYPES, embedding="F16").path
    LLM(model=str(path))  # converted
    assert load_imports(path) == PREPARED_LOAD_IMPORTS + FILE_IMPORTS
    assert_a_load_imports_only_what_load_imports_names(path, os.environ)


def test_a_gguf_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"first")
    first = hashlib.sha256(b"first").hexdigest()[:16]
    assert file_digest(path) == first
    with monkeypatch.context() as patched:  # unchanged: answered without hashing the file again
        patched.setattr(hashlib, "sha256", lambda *args: pytest.fail("the file was hashed again"))
        assert file_digest(path) == first
    path.write_bytes(b"second, longer")
    assert file_digest(path) == hashlib.sha256(b"second, longer").hexdigest()[:16]
    remembered = json.loads((tmp_path / "cache" / FILE_DIGESTS_FILE).read_text())
    expected = [hashlib.sha256(content).hexdigest()[:16] for content in (b"first", b"second, longer")]
    assert sorted(remembered.values()) == sorted(expected)
    # another file of the same size and modification time put in its place (rsync -a, a reproducible archive)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"third, same ln")
    os.utime(other, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    os.replace(other, path)
    assert file_digest(path) == hashlib.sha256(b"third, same ln").hexdigest()[:16]


def test_a_conversion_removes_the_copies_earlier_versions_made_of_the_same_file(tmp_path, monkeypatch, caplog):
    """Nothing reads an older version's copy once this one is written: it goes (the default model's v7 held
    650 MB), whatever digest named it (v13's was the file's bytes', now its place and header). A newer version's
    copy, and other files' copies (a name that only begins like this one's too), stay."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny[1].gguf", "Q8_0").path  # glob's brackets in the name
    stem = f"{path.stem}-{gguf_identity(path)}"
    names = (f"{stem}-v7", f"{path.stem}-0123456789abcdef-v13", f"{stem}-v99", "other-0123-v1")
    older, older_digest, newer, other = (cache_root() / name for name in names)
    longer = cache_root() / f"{path.stem}-extra-0123456789abcdef-v1"
    for directory in (older, older_digest, newer, other, longer):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights")
    with caplog.at_level(logging.INFO, logger="wsgi_infer.engine.loading.model_loader"):
        converted = resolve_model_dir(path)
    assert converted.name == f"{stem}-{CONVERSION_VERSION}" and (converted / "config.json").is_file()
    assert not older.exists() and not older_digest.exists()
    assert newer.exists() and other.exists() and longer.exists()
    assert f"removed {older}, an earlier version's conversion of it" in caplog.text


@pytest.mark.slow
def test_workers_starting_on_a_new_gguf_convert_it_once(default_model_dir, tmp_path):
    """Two workers load the same new GGUF at once: one converts it under its lock, the other waits
    for it and reuses the directory; one class-resolved config is kept."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if (cache_root() / PACKED_ROWS_FILE).is_file():  # measured already: not this test's subject
        shutil.copy(cache_root() / PACKED_ROWS_FILE, cache)
    with GunicornServer({}, "--workers", "2", WSGI_INFER_CACHE_DIR=str(cache)) as server:
        workers = server.wait_booted(count=2)
        conversions = [line for line in server.lines if "reading its config and tokenizer into" in line]
        assert len(conversions) == 1, conversions
        (other,) = [pid for pid in workers if f"[{pid}]" not in conversions[0]]
        server.wait_for_log(rf"\[{other}\] .*loading model from {re.escape(str(cache))}/")
        for worker in workers:  # each one serves what it loaded
            with server.accepting_only_on(worker), server.client() as client:
                reply = client.post("/v1/completions", json={"prompt": "Paris is", "max_tokens": 4})
                assert server.worker_of(reply) == worker
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    converted = [path for path in cache.iterdir() if path.name.endswith(f"-{CONVERSION_VERSION}")]
    assert [path.name for path in converted] == [default_model_dir.name]
    assert len(list((cache / RESOLVED_CONFIGS_DIR).iterdir())) == 1


def test_a_conversion_copies_no_tensor_and_a_load_reads_each_from_its_own_file(tmp_path, monkeypatch):
    """A converted copy keeps no tensor, norms included: a load reads each from the GGUF itself, its values as
    gguf-py gives them, so a float32 load equals transformers' reference on them. The copy is named by the file's
    place and header, not its bytes: another file of the same header (another seed: the same types, shapes and
    metadata) gets a copy of its own, reading its own tensors; a file moved elsewhere, a new one reading it there
    (and the copy of the place it left goes, at that conversion); a file gone, the load says so."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", MIXED_TYPES, embedding="F16").path
    llm = LLM(model=str(path), dtype="float32", quantization="none")
    model_dir = llm.engine.model_dir
    in_file = json.loads((model_dir / FILE_WEIGHTS_FILE).read_text())
    assert in_file["gguf"] == str(path.resolve()) and "model.embed_tokens.weight" in in_file["weights"]
    assert "model.norm.weight" in in_file["weights"] and not list(model_dir.glob("*.safetensors"))
    assert "lm_head.weight" not in in_file["weights"]  # tied: the embedding serves both
    prompt = llm.engine.tokenize("The quick brown fox")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, greedy)[0]
    reference = load_hf_model(model_dir, torch.float32)
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.token_ids == expected[0, len(prompt) :].tolist()

    (tmp_path / "other").mkdir()
    other = write_tiny_gguf(tmp_path / "other" / "tiny.gguf", MIXED_TYPES, seed=1, embedding="F16").path
    header = file_header(path)[2]
    assert header == file_header(other)[2] and path.read_bytes()[:header] == other.read_bytes()[:header]
    other_dir = LLM(model=str(other), dtype="float32", quantization="none").engine.model_dir
    assert other_dir != model_dir and (other_dir / "config.json").read_text() == (model_dir / "config.json").read_text()
    for directory, gguf in ((model_dir, path), (other_dir, other)):
        norm = next(t for t in tensor_table(gguf)[1] if t.name == "output_norm.weight").values()
        assert torch.equal(CheckpointTensors(directory, torch.float32)["model.norm.weight"], norm)

    moved = tmp_path / "elsewhere" / "tiny.gguf"
    moved.parent.mkdir()
    path.rename(moved)
    again = LLM(model=str(moved), dtype="float32", quantization="none")
    assert again.engine.model_dir != model_dir and again.generate(prompt, greedy)[0].token_ids == out.token_ids
    assert not model_dir.exists() and other_dir.exists()  # the copy of a file gone goes at the next conversion
    moved.unlink()
    with pytest.raises(ModelLoadError, match="the GGUF this model was converted from is gone"):
        CheckpointTensors(again.engine.model_dir, torch.float32)["model.embed_tokens.weight"]
