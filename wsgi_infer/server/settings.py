"""Server settings, read from ``WSGI_INFER_*`` environment variables.

The engine's settings are generated from ``EngineConfig``'s fields (their
types, defaults, help and bounds); the server's own are declared here.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_type_hints

from pydantic import Field, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..engine.config import SETTINGS, EngineConfig

_TYPES = get_type_hints(EngineConfig)
EngineSettings = create_model(
    "EngineSettings",
    __base__=BaseSettings,
    **{
        f.name: (_TYPES[f.name], Field(f.default, description=f.metadata["help"], ge=f.metadata.get("ge")))
        for f in SETTINGS
    },
)


class ServerSettings(EngineSettings):
    """Every field is an environment variable: ``max_num_seqs`` is ``WSGI_INFER_MAX_NUM_SEQS``."""

    model_config = SettingsConfigDict(env_prefix="WSGI_INFER_", extra="ignore")

    served_model_name: str | None = Field(
        None, description="name clients send as `model` for the (first) model; default: its directory or file name"
    )
    models: str | None = Field(
        None, description="more models to serve, paths separated by commas; requests choose one by `model`"
    )
    models_dir: str | None = Field(None, description="serve each GGUF file and Hugging Face directory in it")
    models_config: str | None = Field(
        None, description="a TOML file of [models.NAME] tables: path, aliases, preload and the model's own settings"
    )
    preload: str = Field(
        "", description="models loaded at start, names separated by commas, or *; default: the first model"
    )
    models_memory_mb: int | None = Field(
        None,
        ge=1,
        description="memory per worker for the loaded models' weights and KV caches; a load beyond it first "
        "unloads the least recently used models with no open request; default 3/4 of the memory (or the cgroup's "
        "limit) over the workers",
    )
    text_sides_at_start: bool = Field(
        True,
        description="build every served model's tokenizer and grammar compiler as a worker starts, before it is "
        "ready, so that no model's first load stalls the others' streams (building them holds the GIL: 2.6 s for "
        "Gemma 3's 262,144 tokens); costs the start that time and each model about 6 bytes per byte of its "
        "tokenizer.json, within the models' memory budget",
    )
    max_loaded_models: int = Field(0, ge=0, description="the most models a worker keeps loaded (0: as memory allows)")
    keep_alive: float = Field(
        300.0,
        ge=-1,
        description="seconds a model loaded on demand stays loaded with no request (-1: for ever, 0: unloaded once "
        "idle); models loaded at start stay, unless their TOML table sets one",
    )
    kv_cache_memory_mb: int | None = Field(
        None,
        ge=1,
        description="KV cache budget; default on CPU 256, or room for 8,192 tokens where that is more (a 3B: 896); "
        "90% of free memory on CUDA",
    )
    max_waiting_requests: int = Field(256, ge=0, description="sequences (prompts × n) queued past max_num_seqs: 429")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body (413 above)")
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="a request body must arrive whole within this time (408 otherwise; slow clients)"
    )
    heartbeat_seconds: float = Field(5.0, gt=0, description="SSE comment interval while a stream has nothing to send")
    resume_keep_seconds: float = Field(
        60.0, ge=0, description="how long a finished stream stays resumable (GET /v1/streams/<id>)"
    )
    embedding_pooling: Literal["mean", "last"] = Field(
        "mean",
        description="how a generating model embeds (/v1/embeddings): the mean of the prompt's final hidden states, "
        "or the last token's (as llama-server's --pooling); sentence-transformers models pool as they say",
    )
    responses_keep_seconds: float = Field(
        86400.0,
        ge=0,
        description="how long a stored response (/v1/responses with store: true) stays readable and continuable "
        "(in the worker's memory, at most 10,000 per worker, or in Redis with redis_url)",
    )
    stream_backlog_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="a stream whose client is this far behind (or stopped reading) is aborted with an error event",
    )
    redis_url: str | None = Field(
        None,
        description="also copy resumable streams to this Redis (redis://host:port/db): any worker or host resumes them",
    )
    stall_seconds: float = Field(
        60.0,
        gt=0,
        description="requests open but no output from the engine for this long, or one call of the front-end "
        "thread (tokenizing, compiling a constraint) running this long: /health says 503; a request waiting "
        "for the front-end thread this long gets a 503",
    )
    load_wait_seconds: float = Field(
        30.0, ge=0, description="how long a request waits for a worker that is still loading its model"
    )
    serve_load_failure: bool = Field(
        False,
        description="a model that cannot load keeps the worker up answering 503 `failed` (for orchestrators that "
        "read /health); by default the worker exits with gunicorn's boot-error code 3, which stops the server",
    )
    drain_seconds: float | None = Field(
        None,
        gt=0,
        description="on SIGTERM, how long open requests may finish; default graceful_timeout - keepalive - 2",
    )

    api_key: str | None = Field(
        None, description="one key, or several separated by commas; API routes then need `Authorization: Bearer <key>`"
    )
    keys_file: str | None = Field(
        None,
        description="a TOML file of [keys.NAME] tables: each key's weight, priority cap and limits (README, "
        '"Keys, shares and limits"); with api_key, both sets of keys are accepted',
    )
    protect_ops: bool = Field(False, description="with api keys: /health and /metrics need a key too")
    cors_origins: str = Field(
        "", description="origins allowed to call the API from a browser, separated by commas (`*` for any)"
    )

    test_fault_at_step: int = Field(0, ge=0, description="tests only: the engine's step N raises, as a bug would")
    test_stall_after_step: int = Field(
        0,
        ge=0,
        description="tests only: N steps after the last request admitted, the engine takes no step until its next "
        "command, as if stuck",
    )
    test_load_seconds: float = Field(
        0.0, ge=0, description="tests only: every model load takes this much longer, on its loader thread"
    )

    @field_validator("redis_url", "kv_store_url")
    @classmethod
    def _a_url_redis_py_reads(cls, url: str | None) -> str | None:
        """Checked with the settings, in the master: any other URL was each worker's traceback at its start."""
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis-py reads redis://, rediss:// and unix:// URLs only")
        return url

    @field_validator("kv_store_dir")
    @classmethod
    def _a_directory(cls, path: str | None) -> str | None:
        """A file there, or above it, was taken, and each request's write failed on it (a missing directory is
        made, where a directory holds it)."""
        given = Path(path).expanduser() if path else None
        there = next((p for p in (given, *given.parents) if p.exists()), None) if given else None
        if there is not None and not there.is_dir():
            raise ValueError(
                "is not a directory" if there == given else f"{there} is a file: no directory is made in it"
            )
        return path

    @property
    def api_keys(self) -> list[str]:
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]

    def given(self) -> str:
        """The settings given a value (as vLLM logs its non-default arguments): keys shown as set, and a URL's
        password hidden."""
        shown = []
        for name in sorted(self.model_fields_set):
            value = getattr(self, name)
            if name == "api_key":
                value = f"({len(self.api_keys)} keys)"
            elif name in ("redis_url", "kv_store_url") and value:
                value = re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", value)
            shown.append(f"{name}={value}")
        return ", ".join(shown)

    def engine_config(self) -> EngineConfig:
        engine = {f.name: getattr(self, f.name) for f in SETTINGS}
        return EngineConfig(
            **{**engine, "model": self.model or None},
            kv_cache_memory_bytes=self.kv_cache_memory_mb << 20 if self.kv_cache_memory_mb else None,
        )


def toml_tables(path: str | None, section: str, error: type[ValueError], what: str) -> dict:
    """The ``[section.NAME]`` tables of a TOML file (none without a path); ``error`` says what is wrong with it,
    naming it as ``what``."""
    if not path:
        return {}
    try:
        with open(Path(path).expanduser(), "rb") as f:
            document = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise error(f"{what} {path!r}: {exc}") from None
    tables = document.get(section, {})
    if set(document) - {section} or not isinstance(tables, dict):
        raise error(f"{what} {path!r}: only [{section}.NAME] tables are read")
    return tables


# Read by name where no settings object reaches (the cache, the kernels), or set by the master for its workers.
OTHER_VARIABLES = {
    "WSGI_INFER_CACHE_DIR",
    "WSGI_INFER_KERNELS_DIR",
    *("WSGI_INFER_LIMITS_DIR", "WSGI_INFER_OWNS_LIMITS_DIR", "WSGI_INFER_OWNS_METRICS_DIR"),
}


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The WSGI_INFER_* variables that are no setting, each with the setting nearest its name: a misspelt one is
    otherwise ignored without a word (WSGI_INFER_API_KEYS left a server open to every client)."""
    known = {f"WSGI_INFER_{name.upper()}" for name in ServerSettings.model_fields} | OTHER_VARIABLES
    # any case: the settings are read so (a misspelt wsgi_infer_max_num_seq was ignored without a word)
    unknown = sorted(name for name in environ if name.upper().startswith("WSGI_INFER_") and name.upper() not in known)
    return [(name, next(iter(difflib.get_close_matches(name.upper(), known, 1)), None)) for name in unknown]


def table_problems(exc: ValidationError) -> str:
    """A TOML table's error on one line (pydantic's takes several): ``key = value: what is wrong`` for each."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '(table)'} = {e.get('input')!r}: {e['msg']}" for e in exc.errors()
    )


def named_problems(exc: ValidationError) -> list[str]:
    """A settings error, a line per variable at fault: ``WSGI_INFER_NAME=value: what is wrong``."""
    return [
        f"{'WSGI_INFER_' + str(e['loc'][0]).upper() if e['loc'] else 'WSGI_INFER_*'}={e.get('input')!r}: {e['msg']}"
        for e in exc.errors()
    ]
