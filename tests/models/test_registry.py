"""The worker's models in this process (the fast tier): names and aliases, each model's states through loads,
unloads and a failure, and Ollama's keep_alive durations."""

from __future__ import annotations

import shutil

import pytest
from pydantic import TypeAdapter

from wsgi_infer.server.api.bodies.keep_alive import KeepAlive
from wsgi_infer.server.engine_client import served_model
from wsgi_infer.server.engine_client.served_model import RETRY_FAILED_LOAD_SECONDS

from ..conftest import tiny_settings
from ..support.in_process import InProcessServer


@pytest.fixture(scope="module")
def registry(tiny_model_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry")
    (folder / "broken.gguf").write_bytes(b"not a GGUF")
    shutil.copytree(tiny_model_dirs["llama"], folder / "tokenless", ignore=shutil.ignore_patterns("tokenizer*"))
    (folder / "models.toml").write_text(
        f"""
[models.a]
path = "{tiny_model_dirs["llama"]}"
aliases = ["first"]
[models.b]
path = "{tiny_model_dirs["qwen3"]}"
[models.broken]
path = "{folder / "broken.gguf"}"
[models.late]
path = "{folder / "late"}"
[models.later]
path = "{folder / "later"}"
[models.tokenless]
path = "{folder / "tokenless"}"
[models.huge]
path = "{tiny_model_dirs["llama"]}"
kv_cache_memory_mb = 100_000_000
"""
    )
    settings = tiny_settings(tiny_model_dirs, models_config=folder / "models.toml")
    del settings["model"]
    with InProcessServer(settings) as server:
        server.folder = folder
        yield server


def states(http) -> dict[str, str]:
    return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"]}


def test_names_and_aliases_route_and_others_are_a_404(registry):
    with registry.client() as http:
        assert http.get("/v1/models/first").json()["id"] == "a"
        missing = http.post("/v1/completions", json={"model": "c", "prompt": "Hi", "max_tokens": 1})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'a', 'b', 'broken'" in missing.json()["error"]["message"]
        assert http.get("/v1/models/c").status_code == 404
        asked_with_get = http.get("/v1/models/a/load")  # the admin route, not a model named "a/load"
        assert asked_with_get.status_code == 405 and asked_with_get.headers["allow"] == "POST"
        default = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()
        assert default["model"] == "a"


def test_a_model_goes_from_unloaded_to_loaded_and_back(registry):
    with registry.client() as http:
        assert states(http)["b"] == "unloaded"
        assert http.post("/v1/completions", json={"model": "b", "prompt": "Hi", "max_tokens": 1}).status_code == 200
        assert states(http)["b"] == "loaded"
        assert http.post("/v1/models/b/unload").json()["state"] == "unloaded"
        assert states(http)["b"] == "unloaded"
        assert http.post("/v1/models/b/load").json()["state"] == "loaded"
    loads = registry.manager.models["b"].metrics.model_loads._value.get()
    assert loads == 2


def test_a_model_that_cannot_load_is_failed_with_its_reason(registry):
    with registry.client() as http:
        failed = http.post("/v1/completions", json={"model": "broken", "prompt": "Hi", "max_tokens": 1})
        described = http.get("/v1/models/broken").json()
        served = http.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 1})
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_load_failed"
    assert 1 <= int(failed.headers["retry-after"]) <= RETRY_FAILED_LOAD_SECONDS
    assert described["state"] == "failed" and described["failure"].startswith("model failed to load")
    assert "so it is not a GGUF file" in described["failure"]  # the reason itself, not its type alone
    assert served.status_code == 200


def test_a_load_error_of_several_lines_is_told_whole_on_one(registry):
    """transformers' error for a folder without a tokenizer lists its ways on lines of their own: the client was
    told "Couldn't instantiate the backend tokenizer from one of:" and no more."""
    with registry.client() as http:
        refused = http.post("/v1/completions", json={"model": "tokenless", "prompt": "Hi", "max_tokens": 1})
    message = refused.json()["error"]["message"]
    assert refused.status_code == 503 and "\n" not in message and "(1)" in message and "(2)" in message


def test_a_model_larger_than_the_memory_budget_fails_at_once_saying_so(registry):
    """It waited for room no unload could make, and each request was a 503 after the load wait saying the models
    loaded were busy."""
    with registry.client() as http:
        refused = http.post("/v1/completions", json={"model": "huge", "prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
    assert "more than the worker's memory budget" in refused.json()["error"]["message"]
    assert "WSGI_INFER_MODELS_MEMORY_MB" in refused.json()["error"]["message"]


def test_a_model_whose_files_came_after_its_failed_load_loads_when_asked(registry, tiny_model_dirs, monkeypatch):
    """A failure is not for the worker's life: an operator's load tries again at once, a request after a while (it
    stayed failed through both before, until a restart)."""
    with registry.client() as http:
        asks = {name: {"model": name, "prompt": "Hi", "max_tokens": 1} for name in ("late", "later")}
        for ask in asks.values():
            assert http.post("/v1/completions", json=ask).json()["error"]["code"] == "model_load_failed"
        for name in asks:  # their files, copied in at last
            shutil.copytree(tiny_model_dirs["llama"], registry.folder / name)
        assert http.post("/v1/completions", json=asks["late"]).json()["error"]["code"] == "model_load_failed"
        assert http.post("/v1/models/late/load").json()["state"] == "loaded"
        assert http.post("/v1/completions", json=asks["late"]).status_code == 200
        monkeypatch.setattr(served_model, "RETRY_FAILED_LOAD_SECONDS", 0.0)  # the while has passed
        assert http.post("/v1/completions", json=asks["later"]).status_code == 200


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(300, 300), ("10m", 600), ("1h30m", 5400), ("45s", 45), ("1.5s", 1.5), ("0", 0), (-1, -1), ("-5m", -1)],
)
def test_keep_alive_takes_ollamas_durations(given, seconds):
    assert TypeAdapter(KeepAlive).validate_python(given) == seconds


def test_a_keep_alive_that_is_no_duration_is_a_400(registry):
    with registry.client() as http:
        bad = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
    assert 'a duration such as "10m"' in bad.json()["error"]["message"], bad.json()  # it said "a valid number"
