"""Every way a server stops, with real signals and real streaming clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from ..support.server import ENDLESS, ROOT, GunicornServer, dying_with_this_process, wait_until
from ..support.sse_client import events

pytestmark = pytest.mark.slow  # real processes

GRACEFUL = 8
DRAIN = 3
# A quick stop (SIGINT, SIGQUIT) ends every stream and exits "in well under a second" (docs/operations.md); measured
# 0.4 s from the signal to the master's exit, so this bound keeps a margin for a loaded host.
QUICK_STOP_SECONDS = 2.0


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
            and error.json["error"]["type"] == "server_shutdown"
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


def post_on(
    sock: socket.socket, path: str, body: dict, server: GunicornServer | None = None, body_after: str = ""
) -> int:
    """POST on an open connection; with ``body_after``, the body goes only once that log line
    appears. The response's status."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
    sock.sendall(f"{head}\r\n\r\n".encode())
    if body_after:
        server.wait_for_log(body_after)
    sock.sendall(payload)
    return int(sock.makefile("rb").readline().split()[1])


def holder_of(server: GunicornServer, sock: socket.socket) -> int | None:
    try:
        return server.owner_of(sock.getsockname()[1])
    except AssertionError:  # not accepted yet
        return None


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


def assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (
            f"process {pid} left behind"
        )


def test_sigterm_drains_short_streams_and_ends_endless_ones(tiny_model_dirs, record_property):
    # Keep-alive outlasts the gap between the /health call and the request after SIGTERM.
    server = lifecycle_server(tiny_model_dirs, "--keep-alive", "5").wait_ready()
    pids = [server.process.pid, *server.worker_pids()]
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    sdk_stream = sdk.completions.create(
        model=sdk.models.list().data[0].id,
        prompt="endless",
        max_tokens=ENDLESS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(sdk_stream))
    # Short streams take about 1/50 of the drain here (a wide margin for a loaded CI host); endless ones outlast it.
    results, threads = start_streams(server, [20] * 8 + [ENDLESS] * 8)
    keep_alive, probe = (httpx.Client(base_url=server.url, timeout=30) for _ in range(2))
    for client in (keep_alive, probe):
        assert client.get("/health").status_code == 200  # an open keep-alive connection (a load balancer's)

    mark = len(server.lines)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.wait_for_log(r"draining: \d+ open requests", after=mark)
    with pytest.raises(ConnectionRefusedError):  # not taken into the backlog, then reset with its request sent
        socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=5).close()
    health = probe.get("/health")  # a connection's first request after the drain began is its last
    assert health.status_code == 503 and health.json()["status"] == "draining" and health.headers["retry-after"]
    during = keep_alive.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
    assert during.status_code == 503 and during.headers["retry-after"]
    assert during.json()["error"]["code"] == "server_shutting_down"
    with pytest.raises(openai.APIError) as sdk_error:
        for _ in sdk_stream:
            pass
    assert "shutting down" in str(sdk_error.value)

    for t in threads:
        t.join(60)
    last_client = max(r.ended_at for r in results) - signalled
    assert server.process.wait(GRACEFUL + 5) == 0
    master_exit = time.monotonic() - signalled
    assert all(r.error is None for r in results), [r.error for r in results]
    assert all(r.done for r in results[:8]), "short streams must finish inside the drain"
    assert all(r.data[-2].json["choices"][0]["finish_reason"] == "length" for r in results[:8])
    assert all(r.interrupted for r in results[8:]), "endless streams must end with the shutdown event"
    assert not any("SIGKILL" in line or "WORKER TIMEOUT" in line for line in server.wait_eof())
    assert_all_gone(pids)
    record_property("sigterm_last_client_closed_s", round(last_client, 2))
    record_property("sigterm_master_exit_s", round(master_exit, 2))
    print(f"SIGTERM: last client closed after {last_client:.2f} s, master exited after {master_exit:.2f} s")


def test_a_drain_asked_past_graceful_timeout_is_cut_to_it_and_its_streams_still_end_with_their_event(tiny_model_dirs):
    """WSGI_INFER_DRAIN_SECONDS=60 with graceful_timeout 8: the master's kill at 8 s cut the stream mid-body, with
    no terminal event and no word in the log."""
    server = lifecycle_server(tiny_model_dirs, drain_seconds=60).wait_ready()
    results, threads = start_streams(server, [ENDLESS])
    mark = len(server.lines)
    server.process.send_signal(signal.SIGTERM)
    server.wait_for_log(rf"draining: 1 open requests, up to {GRACEFUL - 2:.1f} s", after=mark)
    threads[0].join(GRACEFUL + 10)
    assert server.process.wait(GRACEFUL + 5) == 0
    assert results[0].error is None and results[0].interrupted  # the shutdown event, not a cut body
    assert any("WSGI_INFER_DRAIN_SECONDS=60 is past gunicorn's graceful_timeout" in line for line in server.lines)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGQUIT])
def test_quick_stop_ends_every_stream_at_once(tiny_model_dirs, sig):
    """No drain: the worker ends every stream with its terminal event, then exits; no kill needed."""
    server = lifecycle_server(tiny_model_dirs).wait_ready()
    pids = [server.process.pid, *server.worker_pids()]
    results, threads = start_streams(server, [ENDLESS] * 4)
    mark = len(server.lines)
    signalled = time.monotonic()
    server.process.send_signal(sig)
    for t in threads:
        t.join(30)
    server.process.wait(GRACEFUL)
    exited = time.monotonic()
    assert exited - signalled <= QUICK_STOP_SECONDS
    assert all(r.error is None and r.interrupted for r in results)  # terminal events, not cut connections
    ended, _ = server.wait_for_line(r"quick shutdown: ended 4 open requests", after=mark)
    server.wait_for_line(r"Worker exiting", after=ended)
    assert max(r.ended_at for r in results) <= exited
    assert not any("SIGKILL" in line or "WORKER TIMEOUT" in line for line in server.wait_eof())
    assert_all_gone(pids)
    slowest, master_exit = max(r.ended_at for r in results) - signalled, exited - signalled
    print(
        f"{signal.Signals(sig).name}: last client closed after {slowest:.2f} s, master exited after {master_exit:.2f} s"
    )


def test_quick_stop_with_a_busy_process_on_every_cpu_ends_every_stream(tiny_model_dirs):
    """Beside a busy process per CPU the steps give back threads (the log says so), and a quick stop still ends
    every stream with its terminal event: the engine thread stops at its step's next layer, the worker exits
    without being killed."""
    hogs = [
        subprocess.Popen(dying_with_this_process(["sh", "-c", "while :; do :; done"])) for _ in os.sched_getaffinity(0)
    ]
    try:
        server = lifecycle_server(tiny_model_dirs, quantization="auto").wait_ready()  # packed, on the kernels
        pids = [server.process.pid, *server.worker_pids()]
        results, threads = start_streams(server, [ENDLESS] * 4)
        server.wait_for_log(r"other processes want these CPUs \(.*\): 1 threads a step")
        mark = len(server.lines)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        server.process.wait(GRACEFUL)
        exited = time.monotonic()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"SIGINT beside busy CPUs: master exited after {exited - signalled:.2f} s")
    assert exited - signalled <= QUICK_STOP_SECONDS
    assert all(r.error is None and r.interrupted for r in results)
    stopped, _ = server.wait_for_line(r"engine thread stopped", after=mark)
    assert not any("did not stop within" in line for line in server.wait_eof())
    server.wait_for_line(r"Worker exiting", after=stopped)
    assert_all_gone(pids)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_just_after_the_worker_forks_is_not_lost(tiny_model_dirs, sig):
    """Signalled while its worker is between the fork and gunicorn's own handlers (held there, stopped, by the
    test's configuration), the server still stops as asked once the worker goes on: the worker takes the stop that
    came early, and the master never has to kill it. The real command (not a warm start), as deployed."""
    config = str(Path(__file__).with_name("paused_worker_conf.py"))
    server = lifecycle_server(tiny_model_dirs, "--graceful-timeout", "60", config=config, warm=False)
    worker = int(server.wait_for_log(r"Booting worker with pid: (\d+)").group(1))
    wait_until(lambda: psutil.Process(worker).status() == psutil.STATUS_STOPPED, "the worker held after its fork")
    server.process.send_signal(sig)
    relayed = signal.SIGTERM if sig == signal.SIGTERM else signal.SIGQUIT  # the master's stop for its workers
    wait_until(lambda: relayed in pending_signals(worker), f"{relayed.name} pending on the held worker")
    os.kill(worker, signal.SIGCONT)
    assert server.process.wait(60) == 0
    server.wait_for_log(rf"taking now the stop that came while this worker started \({relayed.name}\)")
    server.wait_for_log(r"engine thread stopped")  # a stop while it loads: once loaded, to the worker's exit
    assert not any("SIGKILL" in line or "did not stop within" in line for line in server.wait_eof())


def pending_signals(pid: int) -> set[int]:
    """The signals sent to process ``pid`` and not yet delivered (a stopped process delivers none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            mask = int(line.split()[1], 16)
            return {number + 1 for number in range(64) if mask >> number & 1}
    return set()


def test_sighup_reload_ends_old_streams_cleanly_and_keeps_serving(tiny_model_dirs):
    with lifecycle_server(tiny_model_dirs) as server:
        server.wait_ready()
        (old_worker,) = server.worker_pids()
        results, threads = start_streams(server, [ENDLESS] * 2)
        # A connection the old worker accepted just before the reload, whose request comes
        # only after that worker began to drain: gunicorn accepted it, so it is served.
        early = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        wait_until(lambda: holder_of(server, early) == old_worker, "the old worker holds the early connection")
        server.process.send_signal(signal.SIGHUP)
        server.wait_for_log(rf"\[{old_worker}\] \[INFO\] draining: \d+ open requests")
        with early:
            assert post_on(early, "/v1/completions", {"prompt": "early", "max_tokens": 2}) == 200
        served = []
        deadline = time.monotonic() + DRAIN + 3
        while time.monotonic() < deadline:  # new connections all along the reload
            with httpx.Client(base_url=server.url, timeout=30) as http:
                served.append(
                    http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2}).status_code
                )
        for t in threads:
            t.join(30)
        assert served and set(served) == {200}
        assert all(r.error is None and r.interrupted for r in results)
        assert not psutil.pid_exists(old_worker) or psutil.Process(old_worker).status() == psutil.STATUS_ZOMBIE
        assert old_worker not in server.worker_pids()


def test_max_requests_recycles_the_worker_with_a_drain(tiny_model_dirs):
    with lifecycle_server(tiny_model_dirs, "--max-requests", "2") as server:
        server.wait_ready()
        (old_worker,) = server.worker_pids()
        results, threads = start_streams(server, [ENDLESS])  # request 1: endless
        # Request 2 reaches max_requests, which starts the drain before the app runs it; its body
        # arrives only once the drain has begun, and gunicorn promises to serve it all the same.
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            body = {"prompt": "two", "max_tokens": 2}
            assert post_on(sock, "/v1/completions", body, server, body_after=r"draining: \d+ open requests") == 200
        # With a single worker, request 3 waits in the listen backlog for the replacement worker.
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "three", "max_tokens": 2}).status_code == 200
        threads[0].join(30)
        assert results[0].error is None and results[0].interrupted
        assert old_worker not in server.worker_pids()


def test_sigkill_of_one_worker_leaves_the_other_workers_streams_alone(tiny_model_dirs):
    """Endless streams, so that each is surely running while its worker is looked up and while the other worker
    dies (a stream of 2,500 tokens could end first on a fast host, and its connection with it)."""
    with lifecycle_server(tiny_model_dirs, "--workers", "2") as server:
        workers = server.wait_booted(count=2)
        results, threads, owners = [], [], []
        for i, worker in enumerate(workers):  # a stream on each, started while the other worker is stopped
            result = StreamResult()
            thread = threading.Thread(target=stream, args=(server, result, ENDLESS, f"s{i}"))
            with server.accepting_only_on(worker):
                thread.start()
                assert result.first_token.wait(60) and result.error is None, result.error
            results.append(result)
            threads.append(thread)
            owners.append(server.owner_of(result.client_port, result))
        assert owners == workers
        victim, survivor = owners[0], results[1]
        killed_at = len(server.lines)
        psutil.Process(victim).send_signal(signal.SIGKILL)
        (replacement,) = server.wait_booted(after=killed_at)
        assert replacement not in workers
        received = len(survivor.data)  # the survivor still streams once the replacement is up
        wait_until(lambda: len(survivor.data) >= received + 50 or survivor.ended_at, "50 more events on the survivor")
        assert survivor.error is None and not survivor.ended_at and len(survivor.data) >= received + 50
        for result in results:
            result.cancel.set()
        for t in threads:
            t.join(60)
        assert survivor.error is None
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200
        # The dead worker's gauges are gone (child_exit): two live engines' worth of blocks, not three.
        single = int(server.wait_for_log(r"KV cache: (\d+) blocks").group(1))
        assert server.metrics()["wsgi_infer:kv_blocks_total"] == 2 * single


# A test run's process that starts a server (forked from the warm-start helper where asked and allowed), then is
# killed from outside before any cleanup of its own: it prints the server's processes, the helper's last.
STARTS_A_SERVER = """
import json, sys
from tests.support import warm_starts
from tests.support.server import GunicornServer
if sys.argv[2] == "warm":
    warm_starts.enable()
server = GunicornServer(json.loads(sys.argv[1]), "--workers", "2")
helper = [warm_starts.WarmStarts._instance.helper.pid] if warm_starts.WarmStarts._instance else []
print(json.dumps([server.process.pid, *server.wait_booted(count=2), *helper]), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_servers_die_with_a_test_run_killed_from_outside(tiny_model_dirs, start):
    settings = {"model": str(tiny_model_dirs["llama"]), "dtype": "float32", "quantization": "none"}
    run = subprocess.Popen(
        [sys.executable, "-c", STARTS_A_SERVER, json.dumps(settings), start],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(run.stdout.readline())  # the master, its two workers, and the helper it forked from
        forked = start == "warm" and not os.environ.get("TEST_SERVERS_START_COLD")
        assert len(pids) == 3 + forked
        processes = [psutil.Process(pid) for pid in pids]
        if forked:
            assert processes[0].ppid() == pids[-1]
    finally:
        run.kill()
        run.wait()
    gone, alive = psutil.wait_procs(processes, timeout=30)
    for process in alive:  # not left to outlive this run too
        process.kill()
    assert alive == [], f"left running after the run was killed: {alive}"


def test_hub_is_never_blocked_by_model_work():
    """With a 5 s heartbeat timeout, loading the default model and a long chunked prefill
    (both longer than that) must not get the worker killed. (Not 2 s: importing torch and
    transformers in post_worker_init, before the worker's loop runs, took over 2 s on a busy host.)"""
    with GunicornServer({"max_num_batched_tokens": 16}, "--timeout", "5") as server:
        server.wait_ready()
        (worker,) = server.worker_pids()
        # 250 prefill steps of the real model: 1,800 tokens took 3.0 s on a Zen 4 (7-8 s on a Zen 3), under the
        # timeout, so that the test showed nothing there; 4,000 take about twice the timeout (10 s on the Zen 4).
        long_prompt = list(range(1000, 5000))
        started = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
        assert r.status_code == 200
        assert server.worker_pids() == [worker]
        assert not any("WORKER TIMEOUT" in line for line in server.lines)
        took = time.monotonic() - started
        print(f"a prefill of {len(long_prompt)} tokens took {took:.1f} s")
        assert took > 5, "the prefill ended within gunicorn's timeout: lengthen it, or the test shows nothing"
