"""The CPUs a worker may use (affinity mask, cgroup quota), and the threads its steps take beside other work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wsgi_infer.engine.runtime import cpu_budget as budget_module
from wsgi_infer.engine.runtime import cpu_share as share_module
from wsgi_infer.engine.runtime.cpu_budget import CpuBudget, cgroup_quota, cpu_budget
from wsgi_infer.engine.runtime.cpu_share import CpuShare, Sample, beside_the_steps

from ..support.prerequisites import unavailable
from ..support.server import GUNICORN, GunicornServer

pytestmark = pytest.mark.slow  # real processes

V1_CPU = Path("/sys/fs/cgroup/cpu")
# Where cpu_budget looks for cgroup v2: the whole tree (a unified host), or beside v1's controllers (a hybrid one).
V2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
ROOT = Path(__file__).resolve().parents[2]
# Run inside the cgroup: its own v2 line of /proc/self/cgroup, then its budget as cpu_budget reads it.
PROBE = """
import json
from pathlib import Path
from wsgi_infer.engine.runtime.cpu_budget import cpu_budget
print(next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")))
print(json.dumps([cpu_budget().cpus, cpu_budget().reason]))
"""


def _group(root: Path, path: str, files: dict[str, str]) -> None:
    (root / path).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / path / name).write_text(text)


def test_a_cgroup_v2_quota_is_the_tightest_along_the_hierarchy(tmp_path):
    _group(tmp_path, "", {"cpu.max": "max 100000\n"})
    _group(tmp_path, "outer", {"cpu.max": "150000 100000\n"})
    _group(tmp_path, "outer/inner", {"cpu.max": "200000 100000\n"})  # looser than its parent's: the parent's holds
    (tmp_path / "self").write_text("0::/outer/inner\n")
    assert cgroup_quota(tmp_path / "self", tmp_path) == (1.5, "cgroup CPU quota of 1.5 CPUs (/outer)")


def test_a_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    _group(tmp_path, "cpu,cpuacct", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    _group(tmp_path, "cpu,cpuacct/job", {"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"})
    (tmp_path / "self").write_text("5:memory:/job\n4:cpu,cpuacct:/job\n")
    assert cgroup_quota(tmp_path / "self", tmp_path) == (0.5, "cgroup CPU quota of 0.5 CPUs (/job)")
    (tmp_path / "self").write_text("4:cpu,cpuacct:/\n")
    assert cgroup_quota(tmp_path / "self", tmp_path) is None  # -1: no quota


def test_the_budget_is_the_smaller_of_the_affinity_mask_and_the_quota(monkeypatch):
    monkeypatch.setattr(budget_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(budget_module, "cgroup_quota", lambda: (2.5, "cgroup CPU quota of 2.5 CPUs (/x)"))
    assert cpu_budget() == CpuBudget(2.5, "cgroup CPU quota of 2.5 CPUs (/x)") and cpu_budget().threads == 2
    monkeypatch.setattr(budget_module, "cgroup_quota", lambda: (8.0, "cgroup CPU quota of 8 CPUs (/x)"))
    assert cpu_budget() == CpuBudget(4.0, "affinity mask: 4 CPUs")  # a quota above the mask: the mask holds
    monkeypatch.setattr(budget_module, "cgroup_quota", lambda: None)
    assert cpu_budget() == CpuBudget(4.0, "affinity mask: 4 CPUs")
    assert CpuBudget(0.3, "tiny quota").threads == 1


def test_the_share_gives_a_thread_back_while_other_processes_crowd_and_takes_it_again_when_a_cpu_is_idle():
    """Per second of stepping: a neighbour busy beside a waiting team costs a thread; a load generator (little CPU
    of others) does not, however long the team waits for the hub; an idle CPU brings the thread back."""
    share, at, counters = CpuShare(2), 0.0, {"waited": 0.0, "idle": 0.0, "busy": 0.0, "ours": 0.0}

    def second(waited: float, idle: float, busy: float, ours: float) -> int:
        nonlocal at
        at += 1.0
        for name, value in (("waited", waited), ("idle", idle), ("busy", busy), ("ours", ours)):
            counters[name] += value
        share._decide(Sample(at, **counters))
        return share.threads

    assert second(0, 0, 0, 0) == 2  # the first sample only starts the counting
    assert second(waited=0.5, idle=0, busy=2.0, ours=1.9) == 2  # the hub and a load generator
    assert second(waited=0.8, idle=0, busy=2.0, ours=1.3) == 1  # a busy neighbour
    assert second(waited=0.0, idle=0, busy=2.0, ours=1.0) == 1  # still there
    assert second(waited=0.0, idle=0.9, busy=1.1, ours=1.0) == 2  # gone
    assert CpuShare(1).threads_for_step() == 1


def test_native_work_beside_the_steps_begins_with_the_next_step_and_has_a_core_until_it_ends(monkeypatch):
    """A grammar vocabulary's build, while steps run: it waits for the step running now to end (that one may hold
    every core), the steps leave it a core while it runs, and take the core back as any thread, once a CPU is idle
    (at once, on a crowded machine, the next steps' barriers would wait on the scheduler)."""
    monkeypatch.setattr(share_module, "STEP_WAIT", 60.0)  # no step comes by itself here: each is called below
    share = CpuShare(3, period=3600.0)  # decides at its first step only: the rest below
    assert share.threads_for_step() == 3  # a step runs now
    began, done = threading.Event(), threading.Event()

    def work() -> None:
        with beside_the_steps():
            began.set()
            done.wait(60)

    worker = threading.Thread(target=work)
    worker.start()
    assert not began.wait(0.5), "it began beside a step that held every core"
    assert share.threads_for_step() == 2  # the next step, without the core the work takes
    assert began.wait(60)
    assert share.threads_for_step() == 2
    done.set()
    worker.join(60)
    assert share.threads_for_step() == 2  # no CPU seen idle yet
    last = share._last
    share._decide(Sample(last.at + 1, last.waited, last.idle + 0.9, last.busy + 1.1, last.ours + 1.0))
    assert share.threads_for_step() == 3
    assert CpuShare(2).threads_for_step() == 2 and CpuShare(1).threads_for_step() == 1


def test_native_work_where_no_step_runs_begins_at_once(monkeypatch):
    monkeypatch.setattr(share_module, "STEP_WAIT", 60.0)
    monkeypatch.setattr(share_module, "_LAST_STEP", [time.monotonic() - 60.0])
    share, began = CpuShare(2), time.monotonic()
    with beside_the_steps():
        assert time.monotonic() - began < 30  # not the wait for a step
        assert share.threads_for_step() == 1


def test_a_server_under_taskset_sizes_its_steps_to_one_cpu(tiny_model_dirs):
    if not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2:
        unavailable("needs taskset and two CPUs")
    command = ["taskset", "-c", "0", GUNICORN, "-c", "gunicorn.conf.py", "--bind", "127.0.0.1:0"]
    with GunicornServer({"model": tiny_model_dirs["llama"]}, command=command) as server:
        server.wait_for_log(r"worker 0 uses the CPU with 1 threads \(affinity mask: 1 CPU\)")
        server.wait_for_log(r"CPU steps use up to 1 threads \(affinity mask: 1 CPU\)")


def test_a_server_in_a_cgroup_with_half_a_cpu_sizes_its_steps_to_one(tiny_model_dirs, tmp_path):
    group = V1_CPU / f"wsgi-infer-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
    except OSError:
        pytest.skip("needs a writable cgroup v1 cpu controller (root)")
    command = ["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {GUNICORN} -c gunicorn.conf.py --bind 127.0.0.1:0"]
    try:
        with GunicornServer({"model": tiny_model_dirs["llama"]}, command=command) as server:
            quota = rf"cgroup CPU quota of 0\.5 CPUs \(/{group.name}\)"
            server.wait_for_log(rf"worker 0 uses the CPU with 1 threads \({quota}\)")
            server.wait_for_log(rf"CPU steps use up to 1 threads \({quota}\)")
    finally:
        group.rmdir()  # its processes have exited with the server


def _cgroup2_mount() -> Path | None:
    """The cgroup2 mount where cpu_budget reads one, mounted at the hierarchy's root; None where there is none."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, fstype = line.split(" - ")[0].split(), line.split(" - ")[1].split()[0]
        if fstype == "cgroup2" and fields[4] in V2_MOUNTS and fields[3] == "/":
            return Path(fields[4])
    return None


def test_a_process_in_a_cgroup_v2_reads_the_tightest_cpu_max_along_its_path():
    """cgroup v2 for real: half a CPU in `cpu.max` on a group, none (`max`) on its child; a process moved into the
    child reads the group's quota."""
    root = _cgroup2_mount()
    if root is None:
        pytest.skip(f"no cgroup2 mount at {' or '.join(V2_MOUNTS)}, where cpu_budget reads cgroup v2")
    enabled = (root / "cgroup.subtree_control").read_text().split()
    if "cpu" not in enabled:
        available = (root / "cgroup.controllers").read_text().split()
        pytest.skip(
            f"the cgroup v2 cpu controller is not enabled below {root} (enabled: {enabled}, available: {available}); "
            "on a hybrid host the cpu controller belongs to cgroup v1"
        )
    outer = root / f"wsgi-infer-test-{os.getpid()}"
    inner = outer / "probe"
    try:
        outer.mkdir()
    except OSError as exc:
        pytest.skip(f"this host does not let the tests create a cgroup under {root}: {exc}")
    try:
        (outer / "cpu.max").write_text("50000 100000")
        (outer / "cgroup.subtree_control").write_text("+cpu")
        inner.mkdir()
        assert (inner / "cpu.max").read_text().split()[0] == "max"  # no quota of its own
        # sh moves itself into the group, then becomes the probe (the same pid), as the v1 test starts gunicorn.
        move_then_run = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(inner / "cgroup.procs")]
        run = subprocess.run(
            [*move_then_run, sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        own_line, budget = run.stdout.splitlines()
        assert own_line == f"0::/{outer.name}/probe"
        assert json.loads(budget) == [0.5, f"cgroup CPU quota of 0.5 CPUs (/{outer.name})"]
    finally:
        for group in (inner, outer):  # the probe has exited, so both are empty
            if group.exists():
                group.rmdir()
