"""API keys and CORS on a real server."""

from __future__ import annotations

import openai
import pytest

from ..support.server import GunicornServer

pytestmark = pytest.mark.slow  # real processes


@pytest.fixture(scope="module")
def server(gunicorn_server, tiny_model_dirs):
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "api_key": "key-one, key-two",
        "cors_origins": "http://app.example",
    }
    return gunicorn_server(settings)


# What openai-node and the anthropic SDK (dangerouslyAllowBrowser) send beside the key from a page.
SDK_HEADERS = "x-stainless-lang, x-stainless-arch, anthropic-version, anthropic-dangerous-direct-browser-access"


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_openai_client_with_a_key_works_and_without_gets_401(server):
    for key in ("key-one", "key-two"):
        client = sdk(server, key)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(server, "key-three").completions.create(model="x", prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and "API key" in str(info.value)
    with server.client() as http:
        r = http.post("/generate", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (
            http.post("/generate", json={"prompt": "hi"}, headers={"Authorization": "Basic key-one"}).status_code == 401
        )


def test_anthropic_client_sends_its_key_as_x_api_key(server):
    import anthropic  # imported here: collecting the SDK costs every test process 2.6 s

    model = sdk(server, "key-one").models.list().data[0].id
    ask = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = anthropic.Anthropic(base_url=server.url, api_key="key-two", max_retries=0).messages.create(**ask)
    assert reply.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="key-three", max_retries=0).messages.create(**ask)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_health_and_metrics_stay_open_by_default(server):
    with server.client() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200


def test_every_path_but_the_chat_page_and_ops_needs_a_key(server):
    """/tokenize and /detokenize too (they load a model that is not loaded), and paths no route serves."""
    with server.client() as http:
        for method, path, body in [
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("POST", "/v1/score", {"text_1": "a", "text_2": "b"}),
            ("GET", "/v1/responses/resp_x", None),
            ("GET", "/no-such-route", None),
        ]:
            refused = http.request(method, path, json=body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
        keyed = http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer key-two"})
        assert keyed.status_code == 200 and keyed.json()["count"] >= 1
        assert http.get("/").status_code == 200 and http.get("/static/app.js").status_code == 200


def test_cors_preflight_and_allowed_origins(server):
    with server.client() as http:
        preflight = http.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": f"authorization, content-type, {SDK_HEADERS}",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        allowed = set(preflight.headers["access-control-allow-headers"].lower().replace(" ", "").split(","))
        assert {"authorization", *SDK_HEADERS.split(", ")} <= allowed  # the SDKs' own were refused: no call went
        other = http.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://evil.example",
                "Access-Control-Request-Method": "POST",
            },
        )
        assert "access-control-allow-origin" not in other.headers
        actual = http.get("/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer key-one"})
        assert actual.headers["access-control-allow-origin"] == "http://app.example"
        assert "origin" in actual.headers["vary"].lower()  # a cache keeps apart what each origin was answered
        exposed = actual.headers["access-control-expose-headers"].lower()
        # what a page reads: the request's id, the stream's to resume it by, and a limited key's budget
        assert {"x-request-id", "x-stream-id", "x-ratelimit-remaining-requests"} <= set(
            exposed.replace(" ", "").split(",")
        )


def test_protected_ops(tiny_model_dirs):
    settings = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "api_key": "k",
        "protect_ops": "true",
    }
    with GunicornServer(settings) as server:
        server.wait_ready()
        with server.client() as http:
            assert http.get("/health").status_code == 401
            assert http.get("/metrics").status_code == 401
            assert http.get("/health", headers={"Authorization": "Bearer k"}).status_code == 200


def test_control_characters_in_headers_never_reach_the_log(server):
    """The access log prints User-Agent and Referer: C0 controls are refused by gunicorn's
    parser, C1 controls (a terminal escape, a line break for str.splitlines) are escaped."""
    import socket

    for probe, value in (("csi", b"a\x9b31mred"), ("nel", b"one\x85two"), ("esc", b"b\x1b[31mred")):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                f"GET /health?probe={probe} HTTP/1.1\r\nHost: x\r\n".encode()
                + b"User-Agent: "
                + value
                + b"\r\nReferer: "
                + value
                + b"\r\nConnection: close\r\n\r\n"
            )
            reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 ")
    assert reply.startswith(b"HTTP/1.1 400")  # ESC: refused before the app, so never logged
    csi = server.wait_for_log(r"GET /health\?probe=csi HTTP/1\.1.*").group(0)
    nel = server.wait_for_log(r"GET /health\?probe=nel HTTP/1\.1.*").group(0)
    assert csi.count("a\\x9b31mred") == 2 and nel.count("one\\x85two") == 2
    assert not any(c in line for line in server.lines for c in "\x1b\x85\x9b")


@pytest.mark.parametrize(("origin", "status"), [("http://evil.example", 403), ("http://app.example", 200), (None, 200)])
def test_a_page_of_another_site_may_not_write_without_asking(server, origin, status):
    """A form or a text/plain body goes to any site without a CORS preflight: on a server without keys, any page a
    user opened could generate or unload a model (keys or not, the server refuses what no allowed page sent)."""
    headers = {"Authorization": "Bearer key-one", "Content-Type": "text/plain"} | ({"Origin": origin} if origin else {})
    body = b'{"prompt": "hi", "max_tokens": 2}'
    with server.client() as http:
        reply = http.post("/v1/completions", content=body, headers=headers)
        assert reply.status_code == status, reply.text
        own = http.post("/v1/completions", content=body, headers={**headers, "Origin": server.url})  # the chat page's
        assert own.status_code == 200, own.text
    if status == 403:
        assert reply.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize(
    ("host", "status"),
    [("rebound.example:8000", 403), ("127.0.0.1:8000", 200), ("localhost:8000", 200), ("[::1]:8000", 200)],
)
def test_a_server_without_keys_takes_a_page_as_its_own_only_where_reached_by_address(tiny_api, host, status):
    """DNS rebinding: a page of a name its attacker points at this server sends that name as its Origin and its
    Host, so the server saw its own page; a name that is no address must be listed (WSGI_INFER_CORS_ORIGINS)."""
    headers = {"Origin": f"http://{host}", "Host": host, "Content-Type": "text/plain"}
    with tiny_api.client() as http:
        reply = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert reply.status_code == status, reply.text


def test_the_master_logs_the_settings_given_without_the_keys(server):
    """As vLLM logs its non-default arguments: the person on call reads why requests are refused or queued."""
    given = server.wait_for_log(r"settings given: (.*)").group(1)
    assert "api_key=(2 keys)" in given and "cors_origins=http://app.example" in given
    assert not any("key-one" in line for line in server.lines)
