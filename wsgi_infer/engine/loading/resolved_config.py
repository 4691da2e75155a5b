"""A model's transformers config, resolved by its architecture's class once per config.json and kept in the cache.

Nothing here imports torch: a process that never imports it resolves a GGUF's config (``text_files``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..runtime.cache_files import cache_root, read_json, write_json
from .model_paths import ModelLoadError

RESOLVED_CONFIGS_DIR = "configs"  # in the cache root: see read_config


def read_config(model_dir: Path):
    """The model's transformers config, resolved by its own class once per config.json, then read back.

    Importing an architecture's config class costs 1.3 s and 80 MB per process (transformers imports
    its kernel hub, torch.distributed and dynamo with it). So the first load keeps the resolved values
    (every default and alias filled in) in the cache, keyed by the file and transformers' version, and
    later loads build a plain ``PreTrainedConfig`` holding them.
    """
    from transformers.configuration_utils import PreTrainedConfig

    values = read_json(resolved_config_file(model_dir))
    if values is None:
        values = resolve_config(model_dir)
    return PreTrainedConfig.from_dict(values | {"_name_or_path": str(model_dir)})  # the same file may be elsewhere


def resolved_config_file(model_dir: Path) -> Path:
    import transformers

    try:
        text = (model_dir / "config.json").read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"model {model_dir}: cannot read config.json ({exc})") from exc
    key = hashlib.sha256(text + transformers.__version__.encode()).hexdigest()[:16]
    return cache_root() / RESOLVED_CONFIGS_DIR / f"{key}.json"


def resolve_config(model_dir: Path) -> dict:
    """The config's values as its class resolves them, kept in the cache for ``load_config``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model {model_dir}: cannot read config.json ({exc})") from exc
    # Aliases (GPT-2's n_embd is hidden_size) as plain values: the plain config has no attribute map. Not where it
    # was read (read_config says where): the same file may be elsewhere, and a conversion reads it from a staging dir.
    values = config.to_dict() | {alias: getattr(config, alias) for alias in config.attribute_map}
    values.pop("_name_or_path", None)
    write_json(resolved_config_file(model_dir), values)
    return values
