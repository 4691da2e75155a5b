"""A gunicorn of ours with one or more workers, for `bench_kv_store.py`: started on a free port with a KV store
directory, ready once every worker's engine answers, and clients whose kept-alive connection a chosen worker holds
(found by the connection's port among the workers' sockets)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from serve_processes import ROOT, free_port, healthy


class Server:
    def __init__(self, model: str | None, store: Path | None, workers: int = 1) -> None:
        self.port = free_port()
        gunicorn = str(Path(sys.executable).with_name("gunicorn"))
        command = [gunicorn, "-c", "gunicorn.conf.py", "--bind", f"127.0.0.1:{self.port}", "--workers", str(workers)]
        env = {**os.environ, "WSGI_INFER_SPECULATIVE": "none", "WSGI_INFER_MAX_WAITING_REQUESTS": "16"}
        env.update({"WSGI_INFER_MODEL": model} if model else {})
        env.update({"WSGI_INFER_KV_STORE_DIR": str(store)} if store else {})
        self.process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = healthy(self.process, f"http://127.0.0.1:{self.port}", command)
        if workers > 1:  # every worker's engine loaded: /health answers from whichever worker accepts
            deadline = time.monotonic() + 600
            while len(self.owners_ready()) < workers and time.monotonic() < deadline:
                time.sleep(0.5)

    def owners_ready(self) -> set[int]:
        seen = set()
        for _ in range(20):
            with httpx.Client(base_url=self.url) as http:
                if http.get("/health").status_code == 200:
                    seen.add(self.owner(http))
        return seen

    def client_on(self, other_than: int | None) -> tuple[httpx.Client, int]:
        """A client whose kept-alive connection a worker holds (not ``other_than``)."""
        while True:
            http = httpx.Client(base_url=self.url, timeout=600)
            http.get("/health")
            if (owner := self.owner(http)) != other_than:
                return http, owner
            http.close()

    def owner(self, http: httpx.Client) -> int:
        (pool,) = [http._transport._pool]
        port = pool.connections[0]._connection._network_stream.get_extra_info("client_addr")[1]
        for child in psutil.Process(self.process.pid).children():
            if any(c.raddr and c.raddr.port == port for c in child.net_connections(kind="tcp")):
                return child.pid
        raise RuntimeError("no worker holds the connection")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)
