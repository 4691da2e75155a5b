"""What the CPU is, from /proc/cpuinfo: its model name and instruction sets. Imports no torch."""

from __future__ import annotations

import functools
import platform


@functools.cache  # a model's load asks for each layer (242 reads of /proc/cpuinfo for the default model: 9 ms)
def _cpuinfo(field: str) -> str | None:
    """The first processor's ``field`` in /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (timings are only comparable on the same one)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())
