"""The ``wsgi-infer`` command, run as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wsgi_infer import SamplingParams
from wsgi_infer.engine.kernels.build import KERNELS_DIR, kernels_library
from wsgi_infer.engine.loading.resolved_config import RESOLVED_CONFIGS_DIR
from wsgi_infer.engine.models import MODEL_REGISTRY

from ..support.server import GUNICORN, ROOT, GunicornServer

pytestmark = pytest.mark.slow  # real processes


def run_cli(*args: str, **variables: str) -> subprocess.CompletedProcess:
    command, env = [sys.executable, "-m", "wsgi_infer.cli", *args], {**os.environ, **variables}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def test_generate_prints_the_greedy_completion(tiny_model_dirs, tiny_llama):
    model = str(tiny_model_dirs["llama"])
    result = run_cli(
        "generate", "Hello there", "--model", model, "--dtype", "float32", "--quantization", "none", "--max-tokens", "8"
    )
    assert result.returncode == 0, result.stderr
    expected = tiny_llama.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0].text
    assert result.stdout == expected + "\n"


def test_ctrl_c_is_the_shells_status_and_one_line(tiny_model_dirs):
    """A KeyboardInterrupt's traceback came from wherever it landed (the kernels, an import)."""
    model = str(tiny_model_dirs["llama"])
    command = [sys.executable, "-m", "wsgi_infer.cli", "generate", "Hello", "--model", model, "--max-tokens", "60000"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        said = next(line for line in iter(process.stderr.readline, "") if "loading model from" in line)
        process.send_signal(signal.SIGINT)  # as that line shows up: mid-load, or generating
        errors = process.stderr.read()
        assert process.wait(60) == 130 and said, errors
    assert errors.strip().splitlines()[-1] == "wsgi-infer: interrupted" and "Traceback" not in errors


def test_missing_model_is_one_clear_error_line(tmp_path):
    missing = tmp_path / "nowhere"
    result = run_cli("generate", "hi", "--model", str(missing))
    assert result.returncode == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"wsgi-infer: error: model {missing}: no such file or directory "
        "(expected a Hugging Face directory or a .gguf file)"
    ]


def test_unsupported_architecture_names_path_and_expectation(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    result = run_cli("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2
    expected = ", ".join(sorted(MODEL_REGISTRY))
    assert f"model {tmp_path}: unsupported architecture 'bert' (expected one of: {expected})" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_with_two_workers_whose_model_cannot_load_exits_with_code_3_and_no_traceback(tmp_path):
    """A misspelt setting is named at start (WSGI_INFER_API_KEYS left a server open without a word). Both workers
    fail to boot: the second's boot error, reaped while the master halted for the first's, escaped
    gunicorn's halt (exit code 1, two HaltServer tracebacks: 4 runs of 4 with a bad device, which the master now
    refuses itself: a GGUF that is none fails each worker's load)."""
    command = [str(Path(sys.executable).with_name("wsgi-infer")), "serve", "--bind", "127.0.0.1:0", "--workers", "2"]
    (tmp_path / "broken.gguf").write_bytes(b"not a GGUF")
    settings = {"model": tmp_path / "broken.gguf", "cache_dir": tmp_path, "api_keys": "secret"}  # and a misspelling
    settings.update(api_key=",", protect_ops="true")  # a key set empty, and what protects nothing: warned of
    with GunicornServer(settings, command=command) as server:
        assert server.process.wait(120) == 3
        server.wait_for_log(r"WSGI_INFER_API_KEYS is no setting of wsgi-infer, ignored: WSGI_INFER_API_KEY\?")
        server.wait_for_log(r"WSGI_INFER_API_KEY is set but holds no key: the API is open to anyone")
        server.wait_for_log(r"WSGI_INFER_PROTECT_OPS does nothing without API keys")
        assert not [line for line in server.wait_eof() if "HaltServer" in line or "arbiter.py" in line]  # the master's
    refused = run_cli("serve", "--workers", "0")  # gunicorn took 0 as its default of 1
    assert refused.returncode == 2 and "--workers: must be a whole number of at least 1" in refused.stderr
    refused = run_cli("prepare", "--workers", "0")  # a ZeroDivisionError's traceback
    assert refused.returncode == 2 and "--workers: must be a whole number of at least 1" in refused.stderr
    # prepare says what the master says of settings: pydantic's error for the field spanned lines, and a misspelt
    # variable was not named
    refused = run_cli("prepare", WSGI_INFER_BLOCK_SIZE="abc", WSGI_INFER_MAX_NUM_SEQ="4", wsgi_infer_max_num_seq="4")
    assert refused.returncode == 2 and "WSGI_INFER_BLOCK_SIZE='abc': Input should be a valid integer" in refused.stderr
    assert "WSGI_INFER_MAX_NUM_SEQ is no setting of wsgi-infer, ignored: WSGI_INFER_MAX_NUM_SEQS?" in refused.stderr
    # in any case, as the settings are read (a lowercase one was read, and a misspelt one ignored without a word)
    assert "wsgi_infer_max_num_seq is no setting of wsgi-infer, ignored: WSGI_INFER_MAX_NUM_SEQS?" in refused.stderr
    for address in ("", "127.0.0.1:99999"):  # it bound 127.0.0.1:8000, unsaid; gunicorn's OverflowError
        refused = run_cli("serve", "--bind", address)
        assert refused.returncode == 2 and "--bind: must be HOST:PORT or unix:PATH" in refused.stderr


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"block_size": "abc"}, "WSGI_INFER_BLOCK_SIZE='abc': Input should be a valid integer"),
        ({"quantization": "int3"}, "the WSGI_INFER_* settings (model "),
        ({"dtype": "int3"}, "dtype must be auto or one of"),  # these two: each worker's traceback, after torch
        ({"device": "gpu"}, "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        ({"kv_store_url": "http://x"}, "WSGI_INFER_KV_STORE_URL='http://x': Value error, redis-py reads"),
        ({"kv_store_dir": "/etc/passwd"}, "WSGI_INFER_KV_STORE_DIR='/etc/passwd': Value error, is not a directory"),
        ({"kv_store_dir": "/etc/passwd/kv"}, "Value error, /etc/passwd is a file: no directory is made in it"),
        ({"keys_file": "/nowhere/keys.toml"}, "keys file '/nowhere/keys.toml': [Errno 2] No such file or directory"),
        (
            {"redis_url": "localhost:6379"},
            "WSGI_INFER_REDIS_URL='localhost:6379': Value error, redis-py reads redis://",
        ),
    ],
)
def test_a_bad_setting_stops_the_master_with_one_line_naming_its_variable(tmp_path, setting, said):
    """Before, each worker imported torch, then printed pydantic's traceback naming the field (block_size), or the
    keys file's error, or redis-py's on a URL it cannot read."""
    assert_stopped_before_any_worker(tmp_path, {f"WSGI_INFER_{k.upper()}": v for k, v in setting.items()}, said)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("-k", "sync"), "--worker-class sync: wsgi-infer serves on its own worker"),  # /health: "loading" for ever
        (("--workers", "0"), "--workers 0: at least 1 worker serves"),  # it listened, and never answered
        (("--worker-connections", "0"), "--worker-connections 0: a worker serves 1 connection at least"),  # all 503
        (("--preload",), "--preload would import torch in the master"),
    ],
)
def test_gunicorn_flags_that_would_serve_no_engine_stop_the_master(tmp_path, flags, said):
    assert_stopped_before_any_worker(tmp_path, {}, said, *flags)


def assert_stopped_before_any_worker(tmp_path: Path, settings: dict, said: str, *flags: str) -> None:
    env = {**os.environ, "WSGI_INFER_CACHE_DIR": str(tmp_path), **settings}
    command = [GUNICORN, "-c", "gunicorn.conf.py", "--bind", "127.0.0.1:0", *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and said in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Booting worker" not in done.stderr  # stopped before any worker


def test_prepare_does_a_first_starts_work_and_the_server_only_reads_it(tiny_model_dirs, tmp_path, monkeypatch):
    """A cache prepared for the server's settings and worker count (a container image's build, say) can be
    read-only: the server measures nothing again and writes nothing there."""
    monkeypatch.setenv("WSGI_INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WSGI_INFER_QUANTIZATION", "int8")  # the server's settings apply
    result = run_cli("prepare", "--model", str(tiny_model_dirs["llama"]), "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert kernels_library() is not None and not (tmp_path / KERNELS_DIR).exists()  # installed: nothing compiled
    assert len(list((tmp_path / RESOLVED_CONFIGS_DIR).iterdir())) == 1
    prepared = _tree(tmp_path)
    with GunicornServer({"model": tiny_model_dirs["llama"]}, "--workers", "2") as server:
        server.wait_booted(count=2)
        first, _ = server.wait_for_line(r"engine ready")
        server.wait_for_line(r"engine ready", after=first + 1)  # both workers
        with server.client() as client:
            assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
        assert not [line for line in server.lines if "(measured)" in line]
    assert _tree(tmp_path) == prepared


def _tree(root) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case: CUDA asked for where there is none")
def test_a_setting_the_machine_cannot_take_fails_its_load_in_one_line(tmp_path):
    """Found by the worker (the master does not import torch): CUDA where there is none was a traceback's worth."""
    with GunicornServer({"device": "cuda", "cache_dir": tmp_path}) as server:
        assert server.process.wait(120) == 3
        server.wait_for_log(r"model failed to load: device: 'cuda' requested but CUDA is not available")
        assert not [line for line in server.lines if "Traceback" in line]
