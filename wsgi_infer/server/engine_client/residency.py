"""Which models stay loaded: a memory budget for their weights and KV caches, a most loaded at once, and the least
recently used model with no request unloaded first to make room. Plain arithmetic, no gevent or torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CPU_KV_CACHE_MB = 256  # the engine's KV budget on the CPU when a model sets none (EngineConfig)
CONVERTED_COPY = 1.2  # a GGUF's converted copy in memory, at most, per byte of the file (issue 52's bound)
BUDGET_SHARE = 0.75  # of the machine's (or cgroup's) memory, split over the workers, by default


@dataclass
class Resident:
    """A loaded (or loading) model as the budget sees it."""

    name: str
    footprint: int  # bytes: its weights and KV cache
    last_used: float  # monotonic seconds of its last request
    busy: bool  # a request is open on it, or it is loading: never unloaded


def evictions(wanted: int, residents: list[Resident], budget: int, most_loaded: int) -> list[str] | None:
    """The models to unload, least recently used first, so that a model of ``wanted`` bytes fits beside the rest
    within ``budget`` bytes and ``most_loaded`` models (0: any number); None when unloading every idle model
    would not make room."""

    def fits(used: int, count: int) -> bool:
        return used + wanted <= budget and (most_loaded <= 0 or count < most_loaded)

    used, count, chosen = sum(r.footprint for r in residents), len(residents), []
    for resident in sorted((r for r in residents if not r.busy), key=lambda r: r.last_used):
        if fits(used, count):
            break
        chosen.append(resident.name)
        used, count = used - resident.footprint, count - 1
    return chosen if fits(used, count) else None


def footprint(path: Path, kv_cache_memory_mb: int | None) -> int:
    """What loading the model at ``path`` takes, estimated before it loads: its weights as the files hold them (a
    GGUF's converted copy at most ``CONVERTED_COPY`` times the file) and its KV cache budget."""
    if path.is_file():
        weights = int(path.stat().st_size * CONVERTED_COPY)
    elif path.is_dir():
        files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
        weights = sum(f.stat().st_size for f in files)
    else:
        weights = 0  # it will fail to load, and say why
    return weights + ((CPU_KV_CACHE_MB if kv_cache_memory_mb is None else kv_cache_memory_mb) << 20)


def default_budget(workers: int) -> int:
    """``BUDGET_SHARE`` of the memory this process may use (the cgroup's limit, else the machine's), per worker."""
    return int(_usable_memory() * BUDGET_SHARE / max(1, workers))


def _usable_memory() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total
