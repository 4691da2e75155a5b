"""What the person on call reads: the access log's lines tied to their requests, and a log config of the operator's
own obeyed by this server's loggers too, on a real server."""

from __future__ import annotations

import json

import pytest

from ..conftest import tiny_settings
from ..support.server import GunicornServer

pytestmark = pytest.mark.slow  # real processes


def test_an_access_line_carries_its_duration_and_request_id(gunicorn_server, tiny_model_dirs):
    """The id ties the line to the response (X-Request-Id) and to the server's own lines of that request."""
    server = gunicorn_server(tiny_settings(tiny_model_dirs))
    mark = len(server.lines)
    with server.client() as http:
        reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "tie-me"})
        basic = http.get("/v1/models", auth=("sk-a-key-in-basic-auth", ""), headers={"X-Request-Id": "basic"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "tie-me"
    server.wait_for_log(r'"POST /v1/completions HTTP/1\.1" 200 \d+ ".*" \d+ms tie-me$', after=mark)
    assert basic.status_code == 200  # no keys here: the header is ignored, and must not reach the log either
    server.wait_for_log(r'^127\.0\.0\.1 - - .*"GET /v1/models HTTP/1\.1" 200 .* basic$', after=mark)
    assert not any("sk-a-key-in-basic-auth" in line for line in server.lines)


def test_a_log_config_of_the_operators_own_places_this_servers_lines_too(tiny_model_dirs, tmp_path):
    """gunicorn's ``--log-config-json``: our loggers took gunicorn's error handler over whatever the file said."""
    config = {
        "version": 1,
        "formatters": {"ours": {"format": "OURS %(name)s: %(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "ours", "stream": "ext://sys.stdout"}},
        "loggers": {"wsgi_infer": {"level": "INFO", "handlers": ["out"], "propagate": False}},
        "root": {"level": "INFO", "handlers": ["out"]},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    with GunicornServer(tiny_settings(tiny_model_dirs), "--log-config-json", str(path)) as server:
        server.wait_for_log(r"^OURS wsgi_infer\.server\.engine_client\.served_model: engine ready: serving")
