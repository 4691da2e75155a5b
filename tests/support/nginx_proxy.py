"""A real nginx, running the shipped scripts/nginx/wsgi-infer.conf with test addresses."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .prerequisites import unavailable
from .server import ROOT, dying_with_this_process, free_port

SHIPPED = ROOT / "scripts" / "nginx" / "wsgi-infer.conf"


def require_nginx() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if path is None:
        unavailable("nginx is not installed")
    return path


class NginxProxy:
    def __init__(self, upstream: str, read_timeout: str = "300s") -> None:
        self.binary = require_nginx()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="wsgi-infer-nginx-"))
        site = SHIPPED.read_text()
        for old, new in (
            ("server 127.0.0.1:8000;", f"server {upstream};"),
            ("listen 80;", f"listen 127.0.0.1:{self.port};"),
            ("proxy_read_timeout 300s;", f"proxy_read_timeout {read_timeout};"),
        ):
            assert old in site, f"the shipped config no longer has {old!r}"
            site = site.replace(old, new)
        (self.dir / "site.conf").write_text(site)
        temp_paths = "\n".join(
            f"{kind}_temp_path {self.dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (self.dir / "nginx.conf").write_text(
            f"user root;\ndaemon off;\nworker_processes 1;\npid {self.dir}/nginx.pid;\n"
            f"error_log {self.dir}/error.log info;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n access_log {self.dir}/access.log;\n {temp_paths}\n include {self.dir}/site.conf;\n}}\n"
        )
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            dying_with_this_process([self.binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf")]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._wait_listening()

    def cut(self) -> None:
        """Stop nginx at once: its open connections drop, as in a proxy restart or network cut."""
        self.process.terminate()
        self.process.wait(10)

    def _wait_listening(self, timeout: float = 60.0) -> None:
        """nginx has no readiness signal but its port: wait until it accepts a connection. (Not a
        proxied request: that would also wait for the upstream, which may still be loading.)"""
        deadline = time.monotonic() + timeout  # bounds a failure only
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"nginx exited: {self.process.stderr.read()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"nginx did not start listening: {self._error_log()}"
                time.sleep(0.05)

    def _error_log(self) -> str:
        log = self.dir / "error.log"
        return log.read_text()[-2000:] if log.exists() else "(no error log)"

    def stop(self) -> None:
        self.cut()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> NginxProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
