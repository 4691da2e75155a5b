"""The CPUs this process may use: its affinity mask and its cgroup's CPU quota, as the JVM and Go runtimes read
them. A quota of 1 CPU on a 2-core machine gives a team of 2 threads half of each period, then throttles both:
every parallel region's barrier then waits out the throttled part. Imports no torch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    cpus: float  # CPUs' worth of time this process may use
    reason: str  # where the limit comes from, for the log

    @property
    def threads(self) -> int:
        """Threads that fit the budget: whole CPUs (a fractional quota's remainder would only throttle a team)."""
        return max(1, math.floor(self.cpus + 1e-9))


def cpu_budget() -> CpuBudget:
    """The smaller of the affinity mask's CPUs and the cgroup quota (the tightest along the cgroup's ancestors)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    budget = CpuBudget(float(affinity), f"affinity mask: {affinity} CPU{'s' if affinity != 1 else ''}")
    quota = cgroup_quota()
    if quota is not None and quota[0] < budget.cpus:
        budget = CpuBudget(quota[0], quota[1])
    return budget


def cgroup_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> tuple[float, str] | None:
    """(CPUs, description) of the tightest CPU quota over this process's cgroup and its ancestors, or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: "0::/path", cpu.max holds "quota period" or "max period"
            found += _limits(root, path, ("", "unified"), _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us
            found += _limits(root, path, (controllers, "cpu", "cpu,cpuacct"), _v1_quota)
    return min(found, default=None)


def _limits(root: Path, path: str, mounts: tuple[str, ...], read) -> list[tuple[float, str]]:
    """Each quota set on the cgroup ``path`` or an ancestor, under the first of ``mounts`` that has it."""
    for mount in mounts:
        base = root / mount if mount else root
        if not (base / path.lstrip("/")).is_dir():
            continue
        limits = []
        group = Path(path)
        while True:
            cpus = read(base / str(group).lstrip("/"))
            if cpus is not None:
                limits.append((cpus, f"cgroup CPU quota of {cpus:g} CPU{'s' if cpus != 1 else ''} ({group})"))
            if group == group.parent:
                return limits
            group = group.parent
    return []


def _v2_quota(group: Path) -> float | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period
