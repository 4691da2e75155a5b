"""A real gunicorn process for end-to-end tests: started, watched through its log, stopped."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx

from . import warm_starts
from .prerequisites import unavailable
from .warm_starts import ROOT, ForkedProcess, dying_with_this_process

GUNICORN = str(Path(sys.executable).with_name("gunicorn"))
# max_tokens of a stream that must still run when a test acts on it: at least a minute of steps on the tiny
# models (a step takes over a millisecond of Python however fast the CPU), within their 65,536-token window.
ENDLESS = 60_000
# httpx gives each client an SSL context of its own, loading the CA bundle: 20-40 ms of CPU, more than a poll of
# /metrics costs the server. These clients speak plain HTTP on loopback, so they share one.
LOOPBACK_TLS = ssl.create_default_context()


def free_port() -> int:
    """A port for a server that cannot bind port 0 and report it (nginx, redis); gunicorn does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str, model_name: str | None = None) -> dict[str, float]:
    """The ``wsgi_infer:*`` samples labelled by model alone, by name: of the model named where several are served."""
    from prometheus_client.parser import text_string_to_metric_families

    values, models = {}, set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("wsgi_infer:") and set(sample.labels) == {"model_name"}:
                if model_name in (None, sample.labels["model_name"]):
                    values[sample.name] = sample.value
                    models.add(sample.labels["model_name"])
    assert len(models) <= 1, f"metrics of several models {sorted(models)}: name the one to read"
    return values


def labelled_samples(text: str, name: str, model_name: str | None = None) -> dict[tuple[tuple[str, str], ...], float]:
    """Metric ``name``'s samples (of one model, where given), by their labels but ``model_name``, sorted pairs."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and model_name in (None, sample.labels.get("model_name")):
                values[tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))] = sample.value
    return values


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` (a metric, a file: nothing to block on from outside) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def stop_together(processes: Iterable[LoggedProcess], sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
    """Signal every process that still runs, then wait for each (killed with its group after ``timeout``) and for
    the end of its log: servers drain side by side, not one after another (a second each)."""
    processes = list(processes)
    running = [p.process for p in processes if p.process.poll() is None]
    for process in running:
        process.send_signal(sig)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for p in processes:
        p.wait_eof()


class LoggedProcess:
    """A process whose every output line is kept, so tests wait for lines instead of sleeping."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.process = self._start(argv, env)
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _start(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen | ForkedProcess:
        return subprocess.Popen(
            dying_with_this_process(argv),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def _read_log(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_for_log(self, pattern: str, timeout: float = 120.0, after: int = 0) -> re.Match:
        """The first log line (from index ``after``) matching ``pattern``; fails on timeout or exit."""
        return self.wait_for_line(pattern, timeout, after)[1]

    def wait_for_line(self, pattern: str, timeout: float = 120.0, after: int = 0) -> tuple[int, re.Match]:
        """The index and match of the first log line (from index ``after``) matching ``pattern``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for index in range(after, len(self.lines)):
                    match = regex.search(self.lines[index])
                    if match:
                        return index, match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof:
                    raise AssertionError(f"no log line matching {pattern!r}; log:\n" + "\n".join(self.lines[-40:]))
                self._changed.wait(remaining)

    def wait_eof(self, timeout: float = 30.0) -> list[str]:
        """Every log line, once the process has exited and its output is read to the end: a test that looks for a
        line that must not be there reads all of them (a master's last words come after its workers' exits)."""
        self.process.wait(timeout)
        with self._changed:
            assert self._changed.wait_for(lambda: self._eof, timeout), "a process still holds the log's pipe open"
            return self.lines

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        stop_together([self], sig, timeout)
        return self.process.returncode

    def __enter__(self) -> LoggedProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class GunicornServer(LoggedProcess):
    """``gunicorn -c gunicorn.conf.py`` on a loopback port of the kernel's choosing, with
    WSGI_INFER_* settings; the port comes from gunicorn's own "Listening at" line.
    """

    def __init__(
        self,
        settings: dict[str, str],
        *args: str,
        command: list[str] | None = None,
        config: str = "gunicorn.conf.py",
        warm: bool = True,
        **env_vars: str,
    ) -> None:
        """``config``: gunicorn's configuration file. ``command`` replaces ``gunicorn -c gunicorn.conf.py`` (for
        `wsgi-infer serve`); it must bind 127.0.0.1:0 itself. ``env_vars`` go to the environment as they are.
        ``warm=False``: the real command even where a warm start could serve (``warm_starts``: tests of the master,
        of imports, of start-up)."""
        env = {**os.environ, **{f"WSGI_INFER_{k.upper()}": str(v) for k, v in settings.items()}, **env_vars}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.warm = warm and command is None
        super().__init__(command or [GUNICORN, "-c", config, "--bind", "127.0.0.1:0", *args], env)
        self.port = int(self.wait_for_log(r"Listening at: http://127\.0\.0\.1:(\d+)\b").group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _start(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen | ForkedProcess:
        forked = warm_starts.start(argv, env) if self.warm else None
        return forked or super()._start(argv, env)

    def wait_booted(self, after: int = 0, count: int = 1) -> list[int]:
        """The pids of the next ``count`` workers booted after log line ``after``, once each
        one's own engine is ready (gunicorn prefixes every line with the process's pid)."""
        pids = []
        for _ in range(count):
            after, match = self.wait_for_line(r"Booting worker with pid: (\d+)", after=after)
            pids.append(int(match.group(1)))
            after += 1
        for pid in pids:
            self.wait_for_log(rf"\[{pid}\] \[INFO\] engine ready: serving")
        return pids

    def wait_ready(self) -> GunicornServer:
        self.wait_for_log(r"engine ready: serving")
        return self

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), verify=LOOPBACK_TLS, **kwargs)

    def metrics(self, model_name: str | None = None) -> dict[str, float]:
        response = httpx.get(f"{self.url}/metrics", timeout=10, verify=LOOPBACK_TLS)
        response.raise_for_status()  # an error's JSON (a worker at its connection limit) is not metrics
        return parse_metrics(response.text, model_name)

    def wait_for_metric(self, name: str, value: float, timeout: float = 30.0) -> None:
        wait_until(lambda: self.metrics()[name] == value, f"{name} == {value}", timeout)

    def owner_of(self, client_port: int, context: object = "") -> int:
        """The worker process holding the server side of the connection from ``client_port`` (``context``: what the
        caller knows of that connection, for the failure's message)."""
        import psutil

        peers = {}
        for pid in self.worker_pids():
            peers[pid] = [conn.raddr.port for conn in psutil.Process(pid).net_connections(kind="tcp") if conn.raddr]
            if client_port in peers[pid]:
                return pid
        raise AssertionError(f"no worker holds the connection from port {client_port} {context} (their peers: {peers})")

    def accepting_only_on(self, pid: int) -> AbstractContextManager[None]:
        """While it lasts, every worker but ``pid`` is stopped, so that ``pid`` accepts every new connection: the
        kernel wakes each worker waiting on the shared socket, and under load one of them won 40 in a row."""
        return self.stopped([worker for worker in self.worker_pids() if worker != pid])

    @contextmanager
    def stopped(self, workers: list[int]) -> Iterator[None]:
        """While it lasts, ``workers`` are stopped (SIGSTOP): new connections wait in the listen queue."""
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        try:
            yield
        finally:
            for worker in workers:
                os.kill(worker, signal.SIGCONT)

    def queued_connections(self) -> int:
        """Connections the kernel has made on the listening socket that no worker has accepted yet (a listening
        socket's receive queue in /proc/net/tcp is its accept queue)."""
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == f"0100007F:{self.port:04X}" and fields[3] == "0A":  # 127.0.0.1, LISTEN
                return int(fields[4].split(":")[1], 16)
        raise AssertionError(f"no socket listens on 127.0.0.1:{self.port}")

    def worker_of(self, response: httpx.Response) -> int:
        """The worker holding the connection that ``response`` came on."""
        return self.owner_of(response.extensions["network_stream"].get_extra_info("client_addr")[1])

    def clients_on_two_workers(self) -> tuple[httpx.Client, httpx.Client]:
        """Once both workers of a two-worker server are ready, a client on each (its one connection kept alive)."""
        clients = []
        for pid in self.wait_booted(count=2):
            with self.accepting_only_on(pid):
                clients.append(self.client())
                assert self.worker_of(clients[-1].get("/health")) == pid
        return clients[0], clients[1]

    def worker_pids(self) -> list[int]:
        """The master's children that are its workers (forks of it): not a process it started to do a step of a
        start beside them (the kernels' build, a GGUF's text files read ahead)."""
        import psutil

        master = psutil.Process(self.process.pid)
        command, workers = master.cmdline(), []
        for child in master.children():
            try:
                if child.cmdline() == command:
                    workers.append(child.pid)
            except psutil.NoSuchProcess:  # a step's process, ended
                continue
        return workers


class RedisServer(LoggedProcess):
    """Debian's redis-server on a loopback port, memory only; restart it on the same port with ``again()``."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server is not installed")
        self.port = port or free_port()
        self.directory = directory
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        super().__init__([*argv, "--dir", str(directory)])
        self.wait_for_log(r"Ready to accept connections", timeout=30)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def again(self) -> RedisServer:
        """A fresh (empty) redis-server on this one's port, once this one has stopped."""
        return RedisServer(self.directory, self.port)
