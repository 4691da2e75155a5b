"""A real gunicorn process for end-to-end tests: started, watched through its log, stopped."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
GUNICORN = str(Path(sys.executable).with_name("gunicorn"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GunicornServer:
    """``gunicorn -c gunicorn.conf.py`` on a free loopback port, with WSGI_INFER_* settings.

    Every log line (gunicorn's and the app's) is kept, and tests wait for lines
    instead of sleeping.
    """

    def __init__(self, settings: dict[str, str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **{f"WSGI_INFER_{k.upper()}": str(v) for k, v in settings.items()}}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.process = subprocess.Popen(
            [GUNICORN, "-c", "gunicorn.conf.py", "--bind", f"127.0.0.1:{self.port}", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read_log, daemon=True).start()

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
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[after:]:
                    match = regex.search(line)
                    if match:
                        return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof:
                    raise AssertionError(f"no log line matching {pattern!r}; log:\n" + "\n".join(self.lines[-40:]))
                self._changed.wait(remaining)

    def wait_ready(self) -> GunicornServer:
        self.wait_for_log(r"engine ready: serving")
        return self

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metrics(self) -> dict[str, float]:
        """The ``wsgi_infer:*`` samples without labels, by name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("wsgi_infer:") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def worker_pids(self) -> list[int]:
        import psutil

        return [child.pid for child in psutil.Process(self.process.pid).children()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> GunicornServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
