"""Test servers forked from a process that has already imported torch and transformers.

A worker's imports are most of a server's start (torch and transformers alone: 2 of the 2.5 s of CPU to "engine
ready" for the tiny Llama on an idle Xeon, more under the suite's load), and the suite starts about 120 workers.
So each test process keeps one helper (run as ``python -m tests.support.warm_starts``) that imports them once,
then forks a real gunicorn master for each server it is asked for: gunicorn parses the same argv, reads the same
environment and configuration, forks its workers, and they import the app after gevent patches them, as usual.

What differs from ``gunicorn -c gunicorn.conf.py``: torch, transformers and the standard modules they bring are
imported before the worker's gevent patch, not after (the master's own imports already are), the master's
command line is the helper's, and it leaves without tearing those imports down (``_leave``). So a server starts
warm only where that cannot matter: its environment differs from the helper's in WSGI_INFER_* settings alone, and
the test asked for no other command. Tests of the master, of imports or of start-up run the real command
(``GunicornServer(..., warm=False)``), as does everything outside pytest; ``TEST_SERVERS_START_COLD=1`` starts
every server cold.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1
# Keys a test process changes between servers that nothing imported ahead reads: the settings, pytest's own.
PER_SERVER = ("WSGI_INFER_", "PYTEST_CURRENT_TEST")
_enabled = False


def enable() -> None:
    """Called by the suite's conftest: servers started in this process may start warm."""
    global _enabled
    _enabled = not os.environ.get("TEST_SERVERS_START_COLD")


class ForkedProcess:
    """What tests use of ``subprocess.Popen``, for a process the helper forked: signals go to it directly, its exit
    status comes from the helper (its parent), written on the status pipe."""

    def __init__(self, argv: list[str], pid: int, stdout_fd: int, status_fd: int) -> None:
        self.args, self.pid, self.returncode = argv, pid, None
        self.stdout = open(stdout_fd, encoding="utf-8", errors="replace")
        self._status, self._status_lock = status_fd, threading.Lock()  # read and closed once, whoever waits

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        with self._status_lock:
            if self.returncode is not None:
                return True
            waiting = select.poll()  # not select(): a test process may hold thousands of sockets
            waiting.register(self._status, select.POLLIN)
        return bool(waiting.poll(None if timeout is None else timeout * 1000))

    def _read_status(self) -> None:
        with self._status_lock:
            if self.returncode is None:
                with open(self._status) as status:
                    self.returncode = int(status.read() or -signal.SIGKILL)  # empty: the helper itself died

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class WarmStarts:
    """This test process's helper: started at the first warm start, ended with the process."""

    _instance: WarmStarts | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        argv = [sys.executable, "-m", __name__, str(theirs.fileno()), str(os.getpid())]
        self.helper = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()]
        )
        theirs.close()
        ours.settimeout(120)  # a helper that hangs fails the test that waits on it
        self._socket, self._lock = ours, threading.Lock()

    @classmethod
    def shared(cls) -> WarmStarts:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.helper.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def can_start(self, env: dict[str, str]) -> bool:
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(key.startswith(PER_SERVER) for key in changed)

    def start(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """``argv`` (a gunicorn command line: its first item is only its name) in a fork of the helper."""
        out_read, out_write = os.pipe()
        status_read, status_write = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": str(ROOT)}).encode()
        try:
            with self._lock:
                socket.send_fds(self._socket, [request], [out_write, status_write])
                reply = self._socket.recv(64)
        finally:
            os.close(out_write)
            os.close(status_write)
        if not reply:
            raise AssertionError(f"the warm-start helper exited ({self.helper.poll()})")
        return ForkedProcess(argv, int(reply), out_read, status_read)


def start(argv: list[str], env: dict[str, str]) -> ForkedProcess | None:
    """``argv`` forked warm where it may be (see the module's text), else None: the caller runs it."""
    if not _enabled:
        return None
    running = WarmStarts._instance is not None and WarmStarts._instance.helper.poll() is None
    if not running and threading.current_thread() is not threading.main_thread():
        return None  # the helper dies with the thread that starts it (PR_SET_PDEATHSIG): the main one outlives all
    helper = WarmStarts.shared()
    return helper.start(argv, env) if helper.can_start(env) else None


# Runs a command that dies with the test process, even one killed from outside (SIGKILL), which runs no cleanup:
# Linux sends the command SIGINT when its parent goes (PR_SET_PDEATHSIG, kept across exec), a quick stop for
# gunicorn, nginx and redis alike. A parent that died before the prctl is caught by its pid.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGINT)
if os.getppid() != int(sys.argv[1]):
    sys.exit("the test run ended before this process started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_this_process(argv: list[str]) -> list[str]:
    """``argv`` run so that it ends with this process (on Linux; the thread that starts it must outlive it, as
    the fixtures' main thread does)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


# The helper's side.


def _serve(control: socket.socket) -> None:
    """Fork a gunicorn master for each request; write each one's exit status to its status pipe once reaped."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up byte is written
    statuses: dict[int, int] = {}
    while True:
        ready = select.select([control, wake_read], [], [])[0]
        if wake_read in ready:
            os.read(wake_read, 4096)
        if control in ready:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
            if not message:
                return  # the test process closed its end
            helper = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become(json.loads(message), fds, parent=helper)
            os.close(fds[0])
            statuses[pid] = fds[1]
            control.send(str(pid).encode())
        _reap(statuses)


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid)
        os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
        os.close(fd)


def _become(request: dict, fds: list[int], parent: int) -> NoReturn:
    """In the fork: a new session whose output is the test's pipe, dying with the helper as a started command
    dies with its test (SIGINT), then gunicorn's own entry point on ``argv``, left as ``_leave`` says."""
    atexit._clear()  # the helper's imports' exit handlers: a cold master has none of them
    os.setsid()
    if not _dies_with(parent):
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[0], 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the helper's socket, and every other server's pipes
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    from gunicorn.app.wsgiapp import run

    try:
        run()
    except SystemExit as leaving:
        _leave(leaving.code)
    _leave(0)


def _leave(code: int | str | None) -> NoReturn:
    """Exit as gunicorn asked (its own exit handlers run, output flushed), without the interpreter's teardown of
    the helper's imports, which a cold master never has: beside a busy process per CPU it made a quick stop's
    master exit after 0.92-1.11 s where a cold one took 0.44-0.57 s (2.28 s once in a loaded run, past the
    test's 2 s bound); 0.25-0.36 s without it (Xeon model 207)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))


def _dies_with(parent: int) -> bool:
    """SIGINT (a quick stop for gunicorn) when ``parent`` ends; False where it already has."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    return os.getppid() == parent


def _import_ahead() -> None:
    """What a worker imports that takes time and reads no per-server setting (see the module's text)."""
    import gunicorn.app.wsgiapp  # noqa: F401
    import gunicorn.workers.ggevent  # noqa: F401
    import pydantic  # noqa: F401
    import torch  # noqa: F401
    import transformers.modeling_rope_utils  # noqa: F401

    # What gunicorn.conf.py imports before it reads its environment (pydantic's models, Flask): a cold master
    # imports them too before any worker forks, so they read no setting; 0.3 s of each start.
    import wsgi_infer.server.gunicorn.worker  # noqa: F401
    import wsgi_infer.server.settings  # noqa: F401


if __name__ == "__main__":
    control_fd, test_process = int(sys.argv[1]), int(sys.argv[2])
    if not _dies_with(test_process):  # ends with the test process, even one killed
        sys.exit("the test process ended before this helper started")
    _import_ahead()
    _serve(socket.socket(fileno=control_fd))
