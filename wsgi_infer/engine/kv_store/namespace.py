"""What a stored block's values depend on besides its tokens, as one digest: no block ever serves another model
or another setting. The weights by content (remembered per file by size and modification time, see
``file_digest``), the model's configuration, the KV cache's layout and type, and the code that computes it: the
package's version and the CPU kernels' build (named by their source, flags and CPU), or torch's version."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..loading.model_paths import file_digest, is_gguf, model_path
from .block_file import VERSION

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model_runner import ModelRunner

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def store_namespace(config: EngineConfig, model_dir: Path, runner: ModelRunner) -> bytes:
    kernels = runner.kernels
    identity = {
        "format": VERSION,
        "package": _package_version(),
        "weights": _weights_digests(config.model, model_dir),
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "device": runner.device.type,
        "dtype": str(runner.dtype),
        "kv_dtype": str(runner.kv_dtype),
        "block_size": runner.block_size,
        "kv_layout": [runner.num_kv_heads, runner.head_dim, [(g.layers, g.window) for g in runner.kv_groups]],
        "quantization": config.quantization,
        "compute": (kernels.build, kernels.planes) if kernels else f"torch {torch.__version__}",
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def _package_version() -> str:
    """The installed version; run from a source tree that was never installed, a digest of the engine's code."""
    try:
        return importlib.metadata.version("wsgi-infer")
    except importlib.metadata.PackageNotFoundError:
        engine = Path(__file__).resolve().parents[1]
        return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(engine.rglob("*.py")))).hexdigest()


def _weights_digests(model: str | None, model_dir: Path) -> list[tuple[str, str]]:
    """A GGUF's own digest (its converted directory is made from it); else every weights file's in the directory."""
    path = model_path(model)
    files = [path] if is_gguf(path) else sorted(f for f in model_dir.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    return [(f.name, file_digest(f)) for f in files]
