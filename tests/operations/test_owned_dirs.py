"""The folders a master makes for its workers (metrics, limits) do not outlive it, even when it is killed outright:
the next server to start removes them, and only them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from wsgi_infer.server.gunicorn.owned_dirs import LOCK_NAME, remove_abandoned_dirs

from ..support.server import ROOT, GunicornServer, parse_metrics, stop_together, wait_until

HOLDS_A_FOLDER = """
import os
from wsgi_infer.server.gunicorn.owned_dirs import make_owned_dir
path = make_owned_dir("wsgi-infer-metrics-")
worker = os.fork()  # inherits the open lock file, as a gunicorn worker does
if worker:
    print(path, worker, flush=True)
input()  # until killed
"""


def test_a_folder_is_removed_once_no_process_holds_its_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDS_A_FOLDER],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        folder, worker = holder.stdout.readline().split()
        held = Path(folder)
        assert held.parent == tmp_path and (held / LOCK_NAME).is_file()
        unlocked = tmp_path / "wsgi-infer-limits-old"  # made by a version without a lock, or being made
        (unlocked / (LOCK_NAME + ".new")).mkdir(parents=True)
        other = tmp_path / "someone-else"  # not ours, unlocked
        other.mkdir()
        (other / LOCK_NAME).touch()
        assert remove_abandoned_dirs(str(tmp_path)) == []
        holder.kill()  # the master alone: its worker still writes there
        holder.wait()
        assert remove_abandoned_dirs(str(tmp_path)) == []
    finally:
        holder.kill()
        holder.wait()
        if worker:  # else it leaves once its stdin, this pipe, closes
            os.kill(int(worker), signal.SIGKILL)
    removed = []
    wait_until(lambda: removed.extend(remove_abandoned_dirs(str(tmp_path))) or removed, "the folder removed")
    assert removed == [str(held)]
    assert not held.exists() and unlocked.is_dir() and other.is_dir()


def exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def owned_dirs_of(master: int) -> list[Path]:
    """The folders whose lock the master ``master`` holds open."""
    return sorted(Path(f.path).parent for f in psutil.Process(master).open_files() if Path(f.path).name == LOCK_NAME)


@pytest.mark.slow  # real servers
def test_a_server_killed_outright_leaves_its_folders_to_the_next_server_to_start(tiny_model_dirs, tmp_path):
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none"}
    # A temporary directory of their own: a server another test starts meanwhile would remove the killed one's too.
    killed, alive = GunicornServer(settings, TMPDIR=str(tmp_path)), GunicornServer(settings, TMPDIR=str(tmp_path))
    try:
        left, kept = owned_dirs_of(killed.process.pid), owned_dirs_of(alive.process.pid)
        assert [(d.parent, d.name.rsplit("-", 1)[0]) for d in left] == [
            (tmp_path, "wsgi-infer-limits"),
            (tmp_path, "wsgi-infer-metrics"),
        ]
        killed.wait_booted()  # its worker holds the lock too
        processes = [psutil.Process(killed.process.pid), *psutil.Process(killed.process.pid).children(recursive=True)]
        os.killpg(killed.process.pid, signal.SIGKILL)  # master and workers: no exit hook runs
        killed.process.wait(10)
        # Each gone (a zombie has closed its files): a worker may take a moment more than its master to exit, and
        # while it holds the lock the folder is rightly kept.
        wait_until(lambda: all(exited(process) for process in processes), "the killed server's processes gone")
        assert all(d.is_dir() for d in left)
        with GunicornServer(settings, TMPDIR=str(tmp_path)) as starting:
            removed = starting.wait_for_log(r"removed \d+ folders left by servers killed outright: (.*)").group(1)
            assert sorted(removed.split()) == list(map(str, left))
            assert not any(d.exists() for d in left)
            assert all(d.is_dir() for d in kept)
            mine = owned_dirs_of(starting.process.pid)
        assert not any(d.exists() for d in mine)  # a server that stops removes its own
    finally:
        stop_together([killed, alive])
    assert not any(d.exists() for d in kept)


@pytest.mark.slow  # real servers
def test_an_upgrade_on_the_fly_serves_on_and_leaves_no_folder(tiny_model_dirs, tmp_path):
    """gunicorn's upgrade on the fly: SIGUSR2 starts a new master beside the old one (a new process image, with the
    environment the old one started with), then the old one is stopped. The new one serves on the same socket and
    counts in folders of its own; each master's folders go with it."""
    settings = {"model": tiny_model_dirs["llama"], "dtype": "float32", "quantization": "none"}
    old = GunicornServer(settings, TMPDIR=str(tmp_path), warm=False).wait_ready()  # the real command, to exec again
    new = None
    try:
        olds, mark = owned_dirs_of(old.process.pid), len(old.lines)
        old.process.send_signal(signal.SIGUSR2)
        new = psutil.Process(int(old.wait_for_log(r"\[(\d+)\] \[INFO\] Starting gunicorn", after=mark).group(1)))
        worker = old.wait_for_log(r"Booting worker with pid: (\d+)", after=mark).group(1)
        old.wait_for_log(rf"\[{worker}\] \[INFO\] engine ready", after=mark)
        news = owned_dirs_of(new.pid)
        assert len(news) == 2 and {d.parent for d in news} == {tmp_path} and not set(news) & set(olds)
        old.process.send_signal(signal.SIGTERM)
        assert old.process.wait(60) == 0
        assert not any(d.exists() for d in olds) and all(d.is_dir() for d in news)
        body = {"prompt": "Upgraded", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{old.url}/v1/completions", json=body, timeout=60).status_code == 200  # the new one's
        metrics = parse_metrics(httpx.get(f"{old.url}/metrics", timeout=10).text)
        assert metrics["wsgi_infer:generation_tokens_total"] == 3
        new.send_signal(signal.SIGTERM)
        new.wait(60)
        assert not any(d.exists() for d in news)
    finally:
        if new is not None and new.is_running():
            new.kill()
        stop_together([old])
