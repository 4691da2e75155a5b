"""A real nginx, running the shipped scripts/nginx/wsgi-infer.conf with test addresses."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .prerequisites import unavailable
from .server import ROOT, free_port, wait_until
from .warm_starts import dying_with_this_process

SHIPPED = ROOT / "scripts" / "nginx" / "wsgi-infer.conf"
SHIPPED_HOSTS = ROOT / "scripts" / "nginx" / "wsgi-infer-hosts.conf"
EXAMPLE_HOSTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")  # the several-host file's


@contextmanager
def silent_address(connects: bool) -> Iterator[str]:
    """A loopback address that never answers: it takes connections and reads nothing (``connects``), as a hung
    server; or its accept queue is full, so that a connect goes unanswered, as a host powered off."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0 if not connects else 16)
        address = "{}:{}".format(*listener.getsockname())
        fillers = [] if connects else [socket.socket() for _ in range(3)]
        for filler in fillers:  # not blocking: the second and third wait for a place in the queue for ever
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
        try:
            yield address
        finally:
            for filler in fillers:
                filler.close()


def require_nginx() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if path is None:
        unavailable("nginx is not installed")
    return path


def _replaced(site: str, changes: list[tuple[str, str]]) -> str:
    for old, new in changes:
        assert old in site, f"the shipped config no longer has {old!r}"
        site = site.replace(old, new)
    return site


class NginxProxy:
    """The shipped one-host file in front of ``upstream``; ``hosts()`` gives the several-host file."""

    def __init__(self, upstream: str, read_timeout: str = "300s", site: str | None = None) -> None:
        self.binary = require_nginx()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="wsgi-infer-nginx-"))
        self.sent: list[str] = []  # the X-Request-Ids of tagged requests, in order
        changes = [("listen 80;", f"listen 127.0.0.1:{self.port};")]
        changes.append(("proxy_read_timeout 300s;", f"proxy_read_timeout {read_timeout};"))
        if site is None:
            site = SHIPPED.read_text()
            changes.append(("server 127.0.0.1:8000;", f"server {upstream};"))
        (self.dir / "site.conf").write_text(_replaced(site, changes))
        temp_paths = "\n".join(
            f"{kind}_temp_path {self.dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (self.dir / "nginx.conf").write_text(
            f"user root;\ndaemon off;\nworker_processes 1;\npid {self.dir}/nginx.pid;\n"
            f"error_log {self.dir}/error.log info;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n log_format upstreams '$http_x_request_id|$upstream_addr|$upstream_status';\n"
            f" access_log {self.dir}/access.log;\n access_log {self.dir}/upstreams.log upstreams;\n"
            f" {temp_paths}\n include {self.dir}/site.conf;\n}}\n"
        )
        self.start()

    @classmethod
    def hosts(cls, upstreams: list[str], round_robin: bool = False) -> NginxProxy:
        """The several-host file with ``upstreams`` (three) for its example hosts; ``round_robin`` sends every
        request to the next host instead (what the routing is measured against)."""
        site = SHIPPED_HOSTS.read_text()
        for example, upstream in zip(EXAMPLE_HOSTS, upstreams, strict=True):
            site = _replaced(site, [(f"server {example} ", f"server {upstream} ")])
        if round_robin:
            site = _replaced(site, [("proxy_pass http://$wsgi_infer_hosts;", "proxy_pass http://wsgi_infer_rr;")])
            site = site.replace("least_conn;", "").replace("upstream wsgi_infer_least_busy", "upstream wsgi_infer_rr")
        return cls("", site=site)

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

    def tagged(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with a new X-Request-Id, remembered in ``sent``: its line in nginx's log tells who served it."""
        request_id = uuid.uuid4().hex
        self.sent.append(request_id)
        return {**headers, "X-Request-Id": request_id}

    def upstreams(self, request_ids: list[str]) -> list[list[tuple[str, str]]]:
        """Per request of ``request_ids`` (tagged), once nginx logs it: each upstream tried, with its status ("502"
        where it refused). nginx writes a request's line after its answer is out, when a client may have read it."""
        logged: dict[str, list[tuple[str, str]]] = {}

        def all_logged() -> bool:
            for line in (self.dir / "upstreams.log").read_text().splitlines():
                request_id, addresses, statuses = line.split("|")
                logged[request_id] = list(zip(addresses.split(", "), statuses.split(", "), strict=True))
            return all(request_id in logged for request_id in request_ids)

        wait_until(all_logged, f"nginx's log of {len(request_ids)} requests")
        return [logged[request_id] for request_id in request_ids]

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
