"""Every way a server stops, with real signals and real streaming clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from ..support.server import ENDLESS, ROOT, wait_until
from ..support.warm_starts import dying_with_this_process
from .lifecycle_servers import GRACEFUL, lifecycle_server, start_streams

pytestmark = pytest.mark.slow  # real processes

# A quick stop (SIGINT, SIGQUIT) ends every stream and exits "in well under a second" (docs/operations.md); measured
# 0.4 s from the signal to the master's exit. The bound catches a drain taken by mistake (30 s on these servers) or a
# kill (40 s), not speed: CI has stalled tests 0.9-2 s.
QUICK_STOP_SECONDS = 10.0


def quick_stop_server(tiny_model_dirs, **settings):
    """A lifecycle server whose drain (30 s) and kill (40 s) are far past the quick stop's bound."""
    return lifecycle_server(tiny_model_dirs, "--graceful-timeout", "40", drain_seconds=30, **settings).wait_ready()


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
    keep_alive, probe, tokenizing, reading = (httpx.Client(base_url=server.url, timeout=30) for _ in range(4))
    for client in (keep_alive, probe, tokenizing, reading):
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
    # any POST is new work, turned away alike; a read is still served
    tokenized = tokenizing.post("/tokenize", json={"prompt": "too late"})
    assert tokenized.status_code == 503 and tokenized.json()["error"]["code"] == "server_shutting_down"
    assert reading.get("/v1/models").status_code == 200
    with pytest.raises(openai.APIError) as sdk_error:
        for _ in sdk_stream:
            pass
    assert "shutting down" in str(sdk_error.value)

    for t in threads:
        t.join(60)
    last_client = max(r.ended_at for r in results) - signalled
    assert server.process.wait(GRACEFUL + 5) == 0
    master_exit = time.monotonic() - signalled
    # the worker left by itself, not by the master's SIGKILL at graceful_timeout (gunicorn logs no word of that)
    server.wait_for_line(r"Worker exiting", after=mark)
    assert master_exit < GRACEFUL - 1, master_exit
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
    server = quick_stop_server(tiny_model_dirs)
    pids = [server.process.pid, *server.worker_pids()]
    results, threads = start_streams(server, [ENDLESS] * 4)
    mark = len(server.lines)
    signalled = time.monotonic()
    server.process.send_signal(sig)
    for t in threads:
        t.join(60)
    server.process.wait(60)
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
        server = quick_stop_server(tiny_model_dirs, quantization="auto")  # packed, on the kernels
        pids = [server.process.pid, *server.worker_pids()]
        results, threads = start_streams(server, [ENDLESS] * 4)
        server.wait_for_log(r"other processes want these CPUs \(.*\): 1 threads a step")
        mark = len(server.lines)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        server.process.wait(60)
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
