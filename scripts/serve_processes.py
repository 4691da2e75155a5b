"""The servers a benchmark starts: ours (gunicorn on a free port, ready at its "engine ready" line), llama.cpp's
and ik_llama.cpp's llama-server (ready at a 200 on /health), and their peak resident memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
IK_NAME = "ik_llama.cpp -rtr"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, wrap: list[str] | None = None, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Our gunicorn on a free port, its command behind `wrap` (taskset, a cgroup) when given, with ``env`` added."""
    port = free_port()
    env = {**os.environ, "WSGI_INFER_DTYPE": args.dtype, "WSGI_INFER_QUANTIZATION": args.quantization, **(env or {})}
    if args.model:  # a path given relative to where the benchmark runs: the server runs in ROOT
        env["WSGI_INFER_MODEL"] = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    process = subprocess.Popen(
        [
            *(wrap or []),
            str(Path(sys.executable).with_name("gunicorn")),
            "-c",
            "gunicorn.conf.py",
            "--bind",
            f"127.0.0.1:{port}",
            "--access-logfile",
            "/dev/null",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready, engine_ready, last_lines = threading.Event(), threading.Event(), deque(maxlen=20)

    def drain() -> None:  # keep reading, or a full pipe would block the server's logging
        for line in process.stdout:
            last_lines.append(line)
            if "engine ready" in line:
                engine_ready.set()
                ready.set()
            if args.server_log:
                sys.stderr.write(line)
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait()
    if not engine_ready.is_set():  # its log ended first: the process may not be reaped yet
        process.wait()
        raise SystemExit("server exited before it was ready; its log's last lines:\n" + "".join(last_lines))
    return process, f"http://127.0.0.1:{port}"


def start_llama_server(
    args, wrap: list[str] | None = None, extra: list[str] = (), binary: str | None = None
) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server (or ``binary``: ik_llama.cpp's) on the peer model: 2048 tokens of context per slot
    (or a long prompt's and its output's), one slot per stream."""
    model = args.peer_model or args.model
    if not model or not model.endswith(".gguf"):
        raise SystemExit("--llama-server needs a GGUF: --model FILE.gguf, or --peer-model FILE.gguf")
    model, port, slots = str(Path(model).resolve()), free_port(), max(args.concurrency)
    web_ui = ["--webui", "none"] if binary else ["--no-webui"]  # ik_llama.cpp's spelling, and llama.cpp's
    binary = str(Path(binary or args.llama_server).resolve())
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), *web_ui]
    per_slot = max(2048, args.prompt_tokens + args.output_len if args.workload == "long" else 0)
    command += ["-t", str(os.cpu_count()), "-np", str(slots), "-c", str(per_slot * slots), *extra]
    log = open(os.environ.get("LLAMA_SERVER_LOG", os.devnull), "w")
    # in a scratch directory: ik_llama.cpp's server writes a llama.log where it runs
    process = subprocess.Popen(
        [*(wrap or []), *command], stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
    )
    return process, healthy(process, f"http://127.0.0.1:{port}", command)


def healthy(process: subprocess.Popen, url: str, command: list[str]) -> str:
    """``url`` once its /health answers 200 (within 5 minutes); the process is killed if it never does."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"did not become healthy: {' '.join(command)}")


def tree_peak_rss_mb(pid: int) -> float:
    """The largest peak RSS (VmHWM, so far) among the server's processes: its worker, with one worker."""
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return max(peak_rss_kb(p.pid) for p in processes) / 1024


def peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0
