"""Which models stay loaded, on real servers: a budget that holds one model unloads the least recently used idle one
and never one under its streams; an idle model unloads after its keep-alive and gives its memory back; the admin
routes load and unload by hand."""

from __future__ import annotations

import threading

import httpx
import psutil
import pytest

from wsgi_infer.engine.loading.model_paths import default_model_path

from ..support.model_servers import serving
from ..support.server import ENDLESS, GunicornServer, labelled_samples, parse_metrics
from ..support.sse_client import events

pytestmark = pytest.mark.slow  # real servers

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory, tiny_model_dirs):
    """Two tiny models and room for one; a request waits 2 s for room."""
    tables = f"""
[models.a]
path = "{tiny_model_dirs["llama"]}"
[models.b]
path = "{tiny_model_dirs["qwen3"]}"
"""
    folder = tmp_path_factory.mktemp("budget")
    yield from serving(folder, tiny_model_dirs, tables, max_loaded_models=1, load_wait_seconds=2)


@pytest.fixture(scope="module", params=["count", "memory"])
def two_of_three(request, tmp_path_factory, tiny_model_dirs):
    """Three tiny models (a loaded at start) and room for two: two loaded at most, or a memory budget two fit in
    (a model's footprint: its KV budget, 256 MiB, and a few MB of weights)."""
    models = {"a": "llama", "b": "qwen3", "c": "gemma3"}
    tables = "".join(f'[models.{name}]\npath = "{tiny_model_dirs[arch]}"\n' for name, arch in models.items())
    room = {"max_loaded_models": 2} if request.param == "count" else {"models_memory_mb": 600}
    yield from serving(tmp_path_factory.mktemp("two"), tiny_model_dirs, tables, load_wait_seconds=30, **room)


@pytest.fixture(scope="module")
def keep_alive_server(tmp_path_factory, tiny_model_dirs):
    """The tiny Llama (loaded at start) and SmolLM2 (a keep-alive of 5 s: the admin test reads its state within it,
    beside a CI stall of up to 2 s), behind an API key."""
    tables = f"""
[models.tiny]
path = "{tiny_model_dirs["llama"]}"
[models.smollm2]
path = "{default_model_path()}"
dtype = "auto"
quantization = "auto"
keep_alive = 5
"""
    yield from serving(tmp_path_factory.mktemp("keep"), tiny_model_dirs, tables, api_key=KEY)


def complete(server: GunicornServer, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)


def states(server: GunicornServer) -> dict[str, str]:
    listed = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    return {m["id"]: m["state"] for m in listed}


def open_stream(
    server: GunicornServer, model: str, max_tokens: int = ENDLESS
) -> tuple[threading.Event, threading.Event]:
    """A long stream on ``model`` (EOS ignored), read on a thread until ``stop`` is set; ``started`` once a token
    came."""
    started, stop = threading.Event(), threading.Event()

    def read() -> None:
        body = {"model": model, "prompt": "Go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in events(r):
                started.set()
                if stop.is_set():
                    return

    threading.Thread(target=read, daemon=True).start()
    assert started.wait(60)
    return started, stop


def test_a_load_beyond_the_budget_unloads_the_least_recently_used_idle_model(one_at_a_time):
    assert states(one_at_a_time) == {"a": "loaded", "b": "unloaded"}
    assert complete(one_at_a_time, "b").status_code == 200
    assert states(one_at_a_time) == {"a": "unloaded", "b": "loaded"}
    one_at_a_time.wait_for_log(r"unloading a \(memory\)")
    one_at_a_time.wait_for_log(r"model a freed")
    gauges = parse_metrics(httpx.get(f"{one_at_a_time.url}/metrics", timeout=10).text, "a")
    names = ("kv_blocks_total", "kv_blocks_free", "num_requests_running", "num_requests_waiting", "model_loaded")
    assert [gauges[f"wsgi_infer:{name}"] for name in names] == [0] * len(names), gauges


def test_where_two_of_three_fit_the_least_recently_used_goes(two_of_three):
    """Not the first loaded, not any: the one used longest ago, round after round."""
    server = two_of_three
    assert complete(server, "b").status_code == 200
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    assert complete(server, "c").status_code == 200  # a was used longest ago
    assert states(server) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
    assert complete(server, "b").status_code == 200  # now c was
    assert complete(server, "a").status_code == 200
    assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    server.wait_for_log(r"unloading c \(memory\)")


def test_a_model_under_its_streams_is_never_unloaded(one_at_a_time):
    complete(one_at_a_time, "b")
    _, stop = open_stream(one_at_a_time, "b")
    refused = complete(one_at_a_time, "a")  # waits load_wait_seconds for room, which the stream holds
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "waits for room" in refused.json()["error"]["message"]
    assert states(one_at_a_time) == {"a": "unloaded", "b": "loaded"}
    stop.set()  # the stream ends: a's next request finds room
    assert complete(one_at_a_time, "a").status_code == 200
    assert states(one_at_a_time) == {"a": "loaded", "b": "unloaded"}


def test_a_finished_stream_replays_after_its_model_is_unloaded(one_at_a_time):
    complete(one_at_a_time, "b")
    body = {"model": "b", "prompt": "Hello", "max_tokens": 6, "stream": True}
    streamed = httpx.post(f"{one_at_a_time.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert complete(one_at_a_time, "a").status_code == 200  # room for a: b goes
    assert states(one_at_a_time) == {"a": "loaded", "b": "unloaded"}
    replayed = httpx.get(f"{one_at_a_time.url}/v1/streams/{streamed.headers['x-stream-id']}", timeout=60)
    data = [[line for line in r.text.splitlines() if line.startswith("data:")] for r in (streamed, replayed)]
    assert data[0] == data[1] and data[0][-1] == "data: [DONE]"


def _answer(server: GunicornServer, model: str, answers: dict[str, httpx.Response]) -> None:
    answers[model] = complete(server, model, max_tokens=100, ignore_eos=True)  # a busy while it generates, too


def test_a_model_a_request_waited_for_is_not_unloaded_before_the_request_submits(tmp_path, tiny_model_dirs):
    """Room for one. a loads for a request while b's request waits for room; a's load ends and b's load goes
    ahead at once, in the same turn of the hub, before a's request has run again: it must find a busy (held by
    its request), not idle, or the request that asked first gets a 503 for a model that just loaded for it."""
    tables = f'[models.a]\npath = "{tiny_model_dirs["llama"]}"\n[models.b]\npath = "{tiny_model_dirs["qwen3"]}"\n'
    settings = {"max_loaded_models": 1, "load_wait_seconds": 30, "test_load_seconds": 4}
    for server in serving(tmp_path, tiny_model_dirs, tables, **settings):
        assert complete(server, "b").status_code == 200  # a goes
        answers: dict[str, httpx.Response] = {}
        asks = {name: threading.Thread(target=_answer, args=(server, name, answers)) for name in "ab"}
        mark = len(server.lines)
        asks["a"].start()
        server.wait_for_log(r"loading a\b", after=mark)  # its load takes 4 s more: b's request waits in it
        asks["b"].start()
        waited, _ = server.wait_for_line(r"b waits for room", after=mark)
        for ask in asks.values():
            ask.join(60)
        ready, _ = server.wait_for_line(r"engine ready: serving a\b", after=mark)
        assert waited < ready  # b asked during a's load: the turn this test is about, not after a's request ran
        assert answers["a"].status_code == 200, answers["a"].text
        assert answers["b"].status_code == 200, answers["b"].text  # once a's request ended
        assert states(server) == {"a": "unloaded", "b": "loaded"}


SMOLLM2_PACKED_MB = 80  # the shipped SmolLM2's packed weights: most of its file's 94 MiB


def test_the_admin_routes_load_and_unload_and_the_memory_comes_back(keep_alive_server):
    server = keep_alive_server
    assert httpx.post(f"{server.url}/models/load", json={"model": "smollm2"}, timeout=30).status_code == 401
    (worker,) = server.worker_pids()
    mark = len(server.lines)
    routed = httpx.post(f"{server.url}/models/load", json={"model": "smollm2"}, headers=AUTH, timeout=120)
    assert routed.json() == {"success": True} and states(server)["smollm2"] == "loaded"
    assert httpx.post(f"{server.url}/models/unload", json={"model": "smollm2"}, headers=AUTH).json()["success"]
    # The baseline after an unload's collection and trim: the load's own trim would return the heap earlier
    # requests left behind, and the rise measured from a baseline holding it would fall short of the weights.
    server.wait_for_log(r"model smollm2 freed", after=mark)
    before = psutil.Process(worker).memory_info().rss
    loaded = httpx.post(f"{server.url}/v1/models/smollm2/load", headers=AUTH, timeout=120)
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    complete(server, "smollm2", max_tokens=8, keep_alive=-1)  # its weights and some KV blocks in use; kept
    with_model = psutil.Process(worker).memory_info().rss
    _, stop = open_stream(server, "smollm2", 4000)  # within its window; a minute of tokens
    busy = httpx.post(f"{server.url}/v1/models/smollm2/unload", headers=AUTH, timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
    assert "has 1 open requests;" in busy.json()["error"]["message"]  # the stream, nothing waiting beside it
    mark = len(server.lines)
    stop.set()
    while (
        unloaded := httpx.post(f"{server.url}/v1/models/smollm2/unload", headers=AUTH, timeout=30)
    ).status_code == 409:
        server.wait_for_log(r"request \w+: response ended early", after=mark)  # the stream's abort, then again
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    server.wait_for_log(r"model smollm2 freed", after=mark)
    after = psutil.Process(worker).memory_info().rss
    print(f"worker RSS: {before >> 20} MiB, with SmolLM2 {with_model >> 20} MiB, after its unload {after >> 20} MiB")
    assert with_model - before >= SMOLLM2_PACKED_MB << 20  # the load raised it by at least its packed weights
    assert with_model - after >= (with_model - before) // 2


def test_the_global_keep_alive_unloads_models_loaded_on_demand_never_those_loaded_at_start(tmp_path, tiny_model_dirs):
    """WSGI_INFER_KEEP_ALIVE (1 s here) unloads an idle model loaded on demand; the one loaded at start, used before
    it and so idle for longer still, stays."""
    tables = f'[models.tiny]\npath = "{tiny_model_dirs["llama"]}"\n[models.b]\npath = "{tiny_model_dirs["qwen3"]}"\n'
    for server in serving(tmp_path, tiny_model_dirs, tables, keep_alive=1):
        mark = len(server.lines)
        assert complete(server, "tiny").status_code == 200 and complete(server, "b").status_code == 200
        server.wait_for_log(r"unloading b \(idle\)", after=mark, timeout=30)
        assert states(server) == {"tiny": "loaded", "b": "unloaded"}
        assert not [line for line in server.lines if "unloading tiny" in line]


def test_an_idle_model_unloads_after_its_keep_alive(keep_alive_server):
    """Its own counts: run alone or after the module's other tests, which load these models too."""
    server = keep_alive_server
    mark = len(server.lines)
    before = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert complete(server, "smollm2").status_code == 200  # its table's keep-alive: 5 s
    server.wait_for_log(r"unloading smollm2 \(idle\)", after=mark, timeout=30)
    assert complete(server, "tiny", keep_alive="0s").status_code == 200  # Ollama's field: unload once idle
    server.wait_for_log(r"unloading tiny \(idle\)", after=mark, timeout=30)
    assert states(server) == {"tiny": "unloaded", "smollm2": "unloaded"}
    assert complete(server, "tiny").status_code == 200  # loaded again on demand
    after = httpx.get(f"{server.url}/metrics", timeout=10).text

    def grew(model: str, name: str, labels: tuple = ()) -> float:
        counts = [labelled_samples(text, name, model).get(labels, 0) for text in (after, before)]
        return counts[0] - counts[1]

    for model, loaded in (("smollm2", 0), ("tiny", 1)):  # each loaded once here: SmolLM2 on demand, tiny again
        assert grew(model, "wsgi_infer:model_loads_total") == 1
        assert grew(model, "wsgi_infer:model_unloads_total", (("reason", "idle"),)) == 1  # after its keep-alive
        assert parse_metrics(after, model)["wsgi_infer:model_loaded"] == loaded
