"""Bad input gets OpenAI-shaped errors with the right status (in this process), while another stream goes on
unharmed (on a real server)."""

from __future__ import annotations

import json
import socket
import threading
from http import HTTPStatus
from pathlib import Path

import httpx
import pytest

from wsgi_infer import SamplingParams

from ..conftest import tiny_settings
from ..support.server import GunicornServer
from ..support.sse_client import events

BODY_LIMIT = 256 << 10  # tiny_settings'
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def api(tiny_api):
    return tiny_api


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    assert contains in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def bad_requests(http: httpx.Client, limit: int) -> None:
    """Each kind of bad request, and the error each gets."""
    assert_error(http.post("/v1/completions", content=b'{"prompt": "unterminated'), 400, contains="malformed")
    assert_error(http.post("/v1/completions", content=b"[1, 2]"), 400, contains="JSON object")
    assert_error(
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": limit}),
        400,
        param="max_tokens",
        contains=f"max_tokens ({limit}) exceeds the context window of {limit}",
    )
    too_long = assert_error(  # no max_tokens sent: it named one, negative (the room left)
        http.post("/v1/completions", json={"prompt": [1] * (limit + 1), "max_tokens": None}),
        400,
        param="prompt",
        contains=f"prompt ({limit + 1} tokens) leaves no room to generate in the context window of {limit} tokens",
    )
    assert too_long["code"] == "context_length_exceeded"
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "temperature": 5}), 400, param="temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "n": 0}), 400, param="n")
    assert_error(http.post("/v1/completions", json={}), 400, param="prompt")
    for empty in ("", [""], [[]]):  # named as [] is (param was null)
        assert_error(http.post("/v1/completions", json={"prompt": empty}), 400, param="prompt", contains="empty")
    assert_error(http.post("/v1/completions", json={"prompt": [10**9]}), 400, contains="token ids")
    assert_error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
        400,
        param="messages.0.role",
    )
    assert_error(http.post("/v1/completions", json={"prompt": "hi", "model": "nope"}), 404, param="model")
    assert_error(http.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 1)}), 413, contains=str(BODY_LIMIT))
    assert_error(http.get("/v1/nothing-here"), 404)
    doubled = http.post("/v1//completions", json={"prompt": "hi"})  # werkzeug's HTML 308 to the client's Host
    assert_error(doubled, 404)
    assert "location" not in doubled.headers
    gzip = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    assert_error(http.post("/v1/completions", content=b"{}", headers=gzip), 415, contains="'gzip'")
    wrong_method = http.get("/v1/chat/completions")
    assert_error(wrong_method, 405)
    assert set(wrong_method.headers["allow"].split(", ")) >= {"POST"}  # RFC 9110: a 405 says which
    # Unknown fields are ignored, as OpenAI's server does.
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "frobnicate": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_requests_get_openai_shaped_errors_naming_the_field(api):
    with api.client() as http:
        bad_requests(http, http.get("/v1/models").json()["data"][0]["max_model_len"])


@pytest.mark.slow
def test_a_chunked_body_over_the_limit_is_a_413_as_one_with_its_length(tiny_server):
    # gunicorn's chunked bodies (an in-process client sends none): werkzeug's stream stopped at the limit without a
    # word, and the cut JSON was "malformed"
    body = json.dumps({"prompt": "x" * (BODY_LIMIT + 1)}).encode()
    at_limit = json.dumps({"prompt": "x", "max_tokens": 1, "pad": ""}).encode()
    at_limit = at_limit.replace(b'"pad": ""', b'"pad": "' + b"y" * (BODY_LIMIT - len(at_limit)) + b'"')
    with tiny_server.client() as http:
        over = http.post("/v1/completions", content=iter([body]), headers=JSON)  # an iterator: chunked
        whole = http.post("/v1/completions", content=iter([at_limit]), headers=JSON)
    assert_error(over, 413, contains=str(BODY_LIMIT))
    assert len(at_limit) == BODY_LIMIT and whole.status_code == 200, whole.text


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [b"zz\r\n", b"3\r\nabcXX\r\n0\r\n\r\n", b"-1\r\n"])
def test_a_malformed_chunk_is_a_400_then_the_close(tiny_server, chunks):
    """gunicorn raises its parse error inside the app as the body is read: that was a 500 and a traceback in the
    error log, and after it gunicorn read the rest as a next request and answered it too, on the same connection."""
    after = len(tiny_server.lines)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
        reply = b""
        while data := sock.recv(65536):  # until the server closes
            reply += data
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"Connection: close" in status, reply
    assert "malformed" in json.loads(body)["error"]["message"]
    tiny_server.wait_for_log(r'"POST /v1/completions HTTP/1\.1" 400', after=after)
    assert not any("Traceback" in line for line in tiny_server.lines[after:])


def test_an_upgrade_to_a_websocket_is_refused_as_such(api):
    """Not as a malformed JSON body (the probe's GET /v1/models was told so): werkzeug's router refuses it."""
    with api.client() as http:
        reply = http.get("/v1/models", headers={"Connection": "Upgrade", "Upgrade": "websocket"})
    assert_error(reply, 400, contains="WebSocket is not served here")


CHUNKED_TOKENIZE = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: "


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sent", "status", "words"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400, "must send a Host header"),
        (b"GET /health HTTP/1.0\r\n\r\n", 200, ""),  # HTTP/1.0 needs none
        (b"GET /health HTTP/1.1\r\nHost: a b/c\r\n\r\n", 400, "is not a host name"),
        (b"GET /health HTTP/1.1\r\nHost: [::1]:8000\r\nConnection: close\r\n\r\n", 200, ""),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, close\r\n\r\n", 200, ""),
        (b"GET /health HTTP/1.2\r\nHost: x\r\nConnection: close\r\n\r\n", 200, ""),  # answered in HTTP/1.1
        (CHUNKED_TOKENIZE + b'gzip, chunked\r\n\r\nf\r\n{"prompt":"hi"}\r\n0\r\n\r\n', 501, "gzip"),
    ],
    ids=["1.1 without Host", "1.0 without Host", "a Host of no host", "an IP literal", "close listed", "1.2", "gzip"],
)
def test_what_http_1_1_refuses_gunicorn_served_is_refused_as_nginx_does(tiny_server, sent, status, words):
    """RFC 9112: Host (section 3.2), a Connection list naming close (9.6), a transfer coding not understood (6.1): a
    JSON error in the API's shape, or the answer, then the close (at once: kept alive, it waited 5 s)."""
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as sock:
        sock.sendall(sent)
        reply = b""
        while data := sock.recv(65536):  # until the server closes
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    version = b"HTTP/1.0" if b" HTTP/1.0\r\n" in sent else b"HTTP/1.1"
    assert head.split(b"\r\n")[0].split(b" ", 2) == [version, b"%d" % status, HTTPStatus(status).phrase.encode()], head
    assert b"\r\nConnection: close\r\n" in head and b"\r\nDate: " in head, head
    answer = json.loads(body)
    assert answer["status"] == "ok" if status == 200 else words in answer["error"]["message"], answer


@pytest.mark.slow
@pytest.mark.parametrize("over", [True, False], ids=["over the limit", "within it"])
def test_a_body_over_the_limit_is_refused_before_its_client_is_asked_to_send_it(tiny_server, over):
    """Expect: 100-continue (curl's, past 1 MB): a body over the limit gets the 413 at once, and the close, not a
    100 (Continue) first, after which gunicorn read it all; a body within it gets the 100, then its answer."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % (BODY_LIMIT + 1 if over else len(body)))
        reply = sock.recv(65536)
        if reply.startswith(b"HTTP/1.1 100 "):
            sock.sendall(body)
        while not reply.rstrip().endswith(b"}") and (data := sock.recv(65536)):  # a JSON answer, whole
            reply += data
        closed = over and sock.recv(1) == b""  # at once, not after the keep-alive's 5 s
    statuses = [int(line.split()[1]) for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses == ([413] if over else [100, 200]), reply
    assert closed == over and (b"Connection: close" in reply) == over, reply
    assert not over or str(BODY_LIMIT) in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]


@pytest.mark.slow
def test_errors_leave_a_concurrent_stream_intact(tiny_server, tiny_llama):
    prompt = "A stream that must not notice the errors around it"
    expected = tiny_llama.generate(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))[0].text
    received = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with tiny_server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
            for event in events(r):
                if event.data and event.data != "[DONE]":
                    received.append(event.json["choices"][0]["text"])
                    started.set()

    background = threading.Thread(target=stream)
    background.start()
    assert started.wait(30)
    with tiny_server.client() as http:
        bad_requests(http, http.get("/v1/models").json()["data"][0]["max_model_len"])
    background.join(60)
    assert "".join(received) == expected


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["directory", "gguf"])
def test_a_model_that_fails_to_load_stops_the_server_with_its_reason(tmp_path, broken):
    """A directory without weights, and a GGUF that is none."""
    model = tmp_path / "model.gguf" if broken == "gguf" else tmp_path / "model"
    if broken == "gguf":
        model.write_bytes(b"GGUF" + bytes(64))
    else:
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    with GunicornServer({"model": model, "cache_dir": tmp_path / "cache"}) as server:
        assert server.process.wait(120) == 3  # gunicorn's boot error, passed on by its master
        server.wait_for_log(r"model failed to load: .*" + str(model))
        server.wait_for_log(r"Reason: Worker failed to boot")


@pytest.mark.slow
def test_exit_code_3_only_when_no_model_loaded_at_start_could_load(tmp_path, tiny_model_dirs):
    """Several models loaded at start: a broken one beside one that loads, the server serves (the broken one
    answers 503); every one broken, it stops with gunicorn's boot error."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    also_broken = tmp_path / "empty"
    also_broken.mkdir()
    (also_broken / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer

    def served(second: Path) -> GunicornServer:
        config = tmp_path / f"{second.name}.toml"
        config.write_text(f'[models.broken]\npath = "{broken}"\n[models.second]\npath = "{second}"\n')
        settings = tiny_settings(tiny_model_dirs, models_config=config, preload="*", cache_dir=tmp_path / "cache")
        del settings["model"]  # the file names every model
        return GunicornServer(settings)

    with served(Path(tiny_model_dirs["llama"])) as server:
        server.wait_ready()
        with server.client() as http:
            good = http.post("/v1/completions", json={"model": "second", "prompt": "Hi", "max_tokens": 2})
            bad = http.post("/v1/completions", json={"model": "broken", "prompt": "Hi", "max_tokens": 2})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
        assert bad.status_code == 503 and bad.json()["error"]["code"] == "model_load_failed"
        assert server.process.poll() is None
    with served(also_broken) as server:
        assert server.process.wait(120) == 3
        server.wait_for_log(r"model failed to load: .*" + str(broken))


@pytest.mark.slow
def test_a_model_that_fails_to_load_can_be_served_as_503s_instead(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with GunicornServer({"model": tmp_path, "serve_load_failure": True}) as server:
        server.wait_for_log(r"model failed to load: .*" + str(tmp_path))
        with server.client() as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert server.process.poll() is None


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", b'{"prompt": "\\ud800 lone", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_engine_lives_on(api, route, body):
    """JSON escapes can spell text no tokenizer takes; it once ended the engine thread."""
    with api.client() as http:
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert_error(response, 400, contains="unicode")
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow
def test_a_constraint_that_does_not_compile_is_a_400_with_its_reason_and_no_traceback(tiny_server):
    mark = len(tiny_server.lines)
    body = {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "^(?=a)b$"}}  # look-arounds: none
    with tiny_server.client() as http:
        response = http.post("/v1/completions", json=body)
        later = {"User-Agent": "the-request-after-the-400"}
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=later).status_code == 200
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"
    assert "look-around" in response.json()["error"]["message"], response.json()
    # The later request's access line is logged after the 400's answer, so whatever the first logged is read by then.
    seen, _ = tiny_server.wait_for_line(r'"the-request-after-the-400" \d+ms \w+$', after=mark)
    assert not any("Traceback" in line for line in tiny_server.lines[mark:seen])  # a client's error, not the server's
