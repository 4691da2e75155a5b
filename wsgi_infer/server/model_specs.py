"""Which models a server serves, under which names, each with its settings.

From the settings, in this order (the first model is the default, for requests that name none):

- ``model`` (``--model``, ``WSGI_INFER_MODEL``; the embedded SmolLM2 when nothing names any model);
- ``models`` (``--model`` given more than once, ``WSGI_INFER_MODELS``): paths separated by commas;
- ``models_dir`` (``--models-dir``): each GGUF file and Hugging Face directory in it, by name;
- ``models_config`` (``--models-config``): a TOML file whose ``[models.NAME]`` tables name a model, add one
  (``path``), and give its own settings over the global ones (``PER_MODEL``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..engine.loading.model_paths import is_embedding_model, model_name, model_path
from .master_reads import as_the_master_read
from .settings import ServerSettings, table_problems, toml_tables

# The settings a model may have of its own (each also a global one, its default).
PER_MODEL = frozenset(
    {
        "kv_cache_memory_mb",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "speculative",
        "num_speculative_tokens",
        "embedding_pooling",
        "quantization",
        "activations",
        "dtype",
        "keep_alive",
    }
)
TABLE_KEYS = PER_MODEL | {"path", "aliases", "preload"}


class ModelsConfigError(ValueError):
    """The models' configuration names something twice, or something unknown."""


@dataclass
class ModelSpec:
    name: str  # what clients send as `model`
    path: str | None  # None: the embedded default model
    settings: ServerSettings  # the global settings with the model's own
    aliases: tuple[str, ...] = ()
    preload: bool = False
    keep_alive: float | None = None  # the table's own; else the global one's for models loaded on demand

    @property
    def files(self) -> Path:
        """Where the model's files are (the embedded default model's GGUF for None)."""
        return model_path(self.path)

    @property
    def task(self) -> str:
        """``embed`` for a sentence-transformers encoder, else ``generate``: known before it loads."""
        return "embed" if self.files.is_dir() and is_embedding_model(self.files) else "generate"


def model_specs(settings: ServerSettings) -> list[ModelSpec]:
    """Every model the settings name, the default first, as the master read them (``master_reads``); raises
    ModelsConfigError."""
    return as_the_master_read("models", settings.model_dump_json(), lambda: read_model_specs(settings))


def read_model_specs(settings: ServerSettings) -> list[ModelSpec]:
    """Every model the settings name, the default first, the models config read now; raises ModelsConfigError."""
    tables = _tables(settings.models_config)
    paths = _paths(settings, any("path" in table for table in tables.values()))
    names = [model_name(p) for p in paths]
    if settings.served_model_name and not names:  # it names WSGI_INFER_MODEL's: a config's tables name their own
        raise ModelsConfigError("WSGI_INFER_SERVED_MODEL_NAME names WSGI_INFER_MODEL's model, and none is given")
    if settings.served_model_name:
        names[0] = settings.served_model_name
    by_path = {str(Path(p).expanduser()) if p else None: i for i, p in enumerate(paths)}
    own: list[dict] = [{} for _ in paths]
    for name, table in tables.items():
        path = table.get("path")
        index = by_path.get(str(Path(path).expanduser())) if path else (names.index(name) if name in names else None)
        if index is None and not path:
            raise ModelsConfigError(f"models config: [models.{name}] has no path, and no model is named {name!r}")
        if index is None:
            paths.append(str(path))
            names.append(name)
            own.append(table)
        else:
            names[index], own[index] = name, table
    specs = [_spec(settings, name, path, table) for name, path, table in zip(names, paths, own)]
    _check_unique(specs)
    _mark_preloads(specs, settings.preload)
    return specs


def _mark_preloads(specs: list[ModelSpec], preload: str) -> None:
    listed = {name.strip() for name in preload.split(",") if name.strip()}
    unknown = listed - {"*"} - {spec.name for spec in specs}
    if unknown:
        raise ModelsConfigError(f"preload names models that are not served: {sorted(unknown)}")
    for spec in specs:
        spec.preload = spec.preload or "*" in listed or spec.name in listed
    if not any(spec.preload for spec in specs):
        specs[0].preload = True  # by default the default model is loaded at start


def _paths(settings: ServerSettings, config_adds_models: bool) -> list[str | None]:
    """The paths the settings list; the embedded default model's (None) where nothing names a model."""
    listed = [p.strip() for p in (settings.models or "").split(",") if p.strip()]
    if settings.models_dir:
        listed += [str(p) for p in _models_in(Path(settings.models_dir).expanduser())]
    if settings.model or not (listed or config_adds_models):
        listed.insert(0, settings.model or None)
    return listed


def _models_in(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ModelsConfigError(f"models_dir {str(directory)!r} is not a directory")
    found = [p for p in sorted(directory.iterdir()) if p.suffix == ".gguf" or (p / "config.json").is_file()]
    if not found:
        raise ModelsConfigError(f"models_dir {str(directory)!r} holds no GGUF file and no Hugging Face directory")
    return found


def _tables(config_file: str | None) -> dict[str, dict]:
    tables = toml_tables(config_file, "models", ModelsConfigError, "models config")
    for name, table in tables.items():
        unknown = set(table) - TABLE_KEYS if isinstance(table, dict) else {"(not a table)"}
        if unknown:
            raise ModelsConfigError(f"models config: [models.{name}] has unknown keys {sorted(unknown)}")
        for key, kind, what in (("path", str, "a string"), ("preload", bool, "true or false")):
            if key in table and not isinstance(table[key], kind):  # "false" preloaded, 5 was a TypeError
                raise ModelsConfigError(f"models config: [models.{name}] {key} must be {what}, got {table[key]!r}")
    return tables


def _spec(settings: ServerSettings, name: str, path: str | None, table: dict) -> ModelSpec:
    own = {key: value for key, value in table.items() if key in PER_MODEL}
    try:
        merged = ServerSettings(**{**settings.model_dump(), **own, "model": path, "served_model_name": name})
        merged.engine_config()  # validates what the engine's settings allow
    except ValueError as exc:  # the table's own values, or the WSGI_INFER_* settings every model takes
        where = f"models config: [models.{name}]" if own else f"the WSGI_INFER_* settings (model {name})"
        raise ModelsConfigError(
            f"{where}: {table_problems(exc) if isinstance(exc, ValidationError) else exc}"
        ) from None
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):  # 5 was a TypeError
        raise ModelsConfigError(f"models config: [models.{name}] aliases must be a list of names")
    keep_alive = merged.keep_alive if "keep_alive" in table else None
    return ModelSpec(name, path, merged, tuple(aliases), table.get("preload", False), keep_alive)


def _check_unique(specs: list[ModelSpec]) -> None:
    seen: dict[str, ModelSpec] = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            if name in seen:  # their files too: two files of one name in two places say only "m and m"
                both = " and ".join(f"{s.name} ({s.files})" for s in (seen[name], spec))
                raise ModelsConfigError(f"the name {name!r} is given to two models: {both}")
            seen[name] = spec
