"""The lifecycle tests' servers (a short drain and graceful timeout) and the streaming clients whose ends they
watch: shared by the tests of a stop (test_lifecycle) and of a worker's replacement (test_worker_replacement)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from ..support.server import GunicornServer
from ..support.sse_client import events

GRACEFUL = 8
DRAIN = 3


@dataclass
class StreamResult:
    data: list = field(default_factory=list)  # data events, in order
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0
    error: Exception | None = None
    client_port: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return bool(self.data) and self.data[-1].data == "[DONE]"

    @property
    def interrupted(self) -> bool:
        """Ended with an abort chunk, then an error event with a retry hint, and no [DONE]."""
        if len(self.data) < 2 or any(e.data == "[DONE]" for e in self.data):
            return False
        error, abort = self.data[-1], self.data[-2]
        return (
            error.name == "error"
            and error.retry is not None
            and error.json["error"]["code"] == "server_shutting_down"
            and error.json["error"]["type"] == "service_unavailable_error"
            and abort.json["choices"][0]["finish_reason"] == "abort"
        )


def stream(server: GunicornServer, result: StreamResult, max_tokens: int, prompt: str = "Tell me a story") -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0)) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                result.client_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
                for event in events(r):
                    if event.data:
                        result.data.append(event)
                        result.first_token.set()
                    if result.cancel.is_set():
                        break
    except Exception as exc:  # recorded and asserted on by the test
        result.error = exc
    result.ended_at = time.monotonic()
    result.first_token.set()


def start_streams(server, max_tokens_list: list[int]) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in max_tokens_list]
    threads = [
        threading.Thread(target=stream, args=(server, r, n, f"Story {i}"))
        for i, (r, n) in enumerate(zip(results, max_tokens_list))
    ]
    for t in threads:
        t.start()
    for r in results:
        assert r.first_token.wait(60)
    return results, threads


def lifecycle_server(
    tiny_model_dirs, *args, warm: bool = True, config: str = "gunicorn.conf.py", **settings
) -> GunicornServer:
    base = {
        "model": tiny_model_dirs["llama"],
        "dtype": "float32",
        "quantization": "none",
        "heartbeat_seconds": 0.5,
        "drain_seconds": DRAIN,
    }
    return GunicornServer(
        {**base, **settings}, "--graceful-timeout", str(GRACEFUL), "--keep-alive", "2", *args, config=config, warm=warm
    )
