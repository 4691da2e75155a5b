"""Which models stay loaded: a memory budget for their weights and KV caches (and the text sides kept of those
unloaded), a most loaded at once, and the least recently used model with no request unloaded first to make room.
Plain arithmetic on what a model's files say (their sizes, the shape its KV cache takes), no gevent or torch."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ...engine.config import default_cpu_kv_bytes
from ...engine.loading.gguf_header import file_header

CONVERTED_COPY = 1.2  # a GGUF's converted copy in memory, at most, per byte of the file (issue 52's bound)
BUDGET_SHARE = 0.75  # of the machine's (or cgroup's) memory, split over the workers, by default


@dataclass
class Resident:
    """A model as the budget sees it: loaded (or loading), or unloaded with its text side kept."""

    name: str
    footprint: int  # bytes: its weights and KV cache; 0 when it is not loaded
    last_used: float  # monotonic seconds of its last request
    busy: bool  # a request is open on it, or it is loading: never unloaded
    text: int = 0  # bytes: its text side (tokenizer, grammar vocabulary), kept across unloads (``text_side``)


@dataclass
class Evictions:
    unload: list[str] = field(default_factory=list)  # models to unload, least recently used first
    forget_text: list[str] = field(default_factory=list)  # text sides to let go of, of unloaded models


def evictions(wanted: int, residents: list[Resident], budget: int, most_loaded: int) -> Evictions | None:
    """What must go, least recently used first, so that a model of ``wanted`` bytes fits beside the rest within
    ``budget`` bytes and ``most_loaded`` loaded models (0: any number); None when letting every idle model go would
    not make room. Kept text sides of unloaded models go first (a load rebuilds one in a second or two); then idle
    models unload, each keeping its text side where that leaves room."""
    used = sum(r.footprint + r.text for r in residents)
    count = sum(1 for r in residents if r.footprint)
    plan = Evictions()

    def fits_memory() -> bool:
        return used + wanted <= budget

    def fits() -> bool:
        return fits_memory() and (most_loaded <= 0 or count < most_loaded)

    idle = sorted((r for r in residents if not r.busy), key=lambda r: r.last_used)
    for resident in (r for r in idle if not r.footprint and r.text):
        if fits_memory():
            break
        plan.forget_text.append(resident.name)
        used -= resident.text
    for resident in (r for r in idle if r.footprint):
        if fits():
            break
        plan.unload.append(resident.name)
        used, count = used - resident.footprint, count - 1
        if not fits_memory() and resident.text:  # its own text side before the next model's weights
            plan.forget_text.append(resident.name)
            used -= resident.text
    return plan if fits() else None


def footprint(path: Path, kv_cache_memory_mb: int | None) -> int:
    """What loading the model at ``path`` takes, estimated before it loads: its weights as the files hold them (a
    GGUF's converted copy at most ``CONVERTED_COPY`` times the file) and its KV cache budget (the engine's default
    on a CPU for its shape where none is set)."""
    if path.is_file():
        weights = int(path.stat().st_size * CONVERTED_COPY)
    elif path.is_dir():
        files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
        weights = sum(f.stat().st_size for f in files)
    else:
        weights = 0  # it will fail to load, and say why
    if kv_cache_memory_mb is None:
        return weights + default_cpu_kv_bytes(kv_token_bytes(path))
    return weights + (kv_cache_memory_mb << 20)


def kv_token_bytes(path: Path) -> int:
    """A token's keys and values in a CPU cache (IEEE halves), from the model's GGUF header or ``config.json``; 0
    where neither tells (the engine's least cache then)."""
    try:
        if path.is_file():
            metadata = file_header(path)[0]
            prefix = metadata["general.architecture"] + "."
            layers, heads = metadata[prefix + "block_count"], metadata[prefix + "attention.head_count"]
            kv_heads = metadata.get(prefix + "attention.head_count_kv", heads)
            head_dim = metadata.get(prefix + "attention.key_length") or metadata[prefix + "embedding_length"] // heads
        else:
            config = json.loads((path / "config.json").read_text())
            config = config.get("text_config", config)
            layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads") or heads
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = max(kv_heads) if isinstance(kv_heads, list) else kv_heads  # per layer in some files
        return 2 * layers * kv_heads * head_dim * 2
    except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError, struct.error):  # not a model's files
        return 0


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
