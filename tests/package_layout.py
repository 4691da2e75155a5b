"""The package's layout as the house rules declare it: where it is, its layers, the engine's torch-free core, what
the gunicorn master imports, the engine's vocabulary the server shares; and ``plant``, a copy of its tree with
violations written in, for each rule to fail on."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "wsgi_infer"
SERVER_ONLY = ("gevent", "flask", "pydantic", "prometheus_client", "gunicorn")
# The engine's torch-free core: its vocabulary, the scheduling, and the runtime's plain-Python parts.
ENGINE_CORE = (
    "wsgi_infer.engine.config",
    "wsgi_infer.engine.sampling_params",
    "wsgi_infer.engine.outputs",
    "wsgi_infer.engine.messages",
    "wsgi_infer.engine.scheduling.sequence",
    "wsgi_infer.engine.scheduling.block_manager",
    "wsgi_infer.engine.scheduling.kv_cache_manager",
    "wsgi_infer.engine.scheduling.scheduler",
    "wsgi_infer.engine.scheduling.step_budget",
    "wsgi_infer.engine.runtime.cpu_share",
    "wsgi_infer.engine.runtime.step_interrupt",
    "wsgi_infer.engine.text.bad_words",
    "wsgi_infer.engine.text.chat_template",
    "wsgi_infer.engine.text.token_pieces",
    "wsgi_infer.engine.text.truncation",
)
MASTER_MODULES = ("gunicorn.worker", "gunicorn.config", "gunicorn.logger", "settings")
# The server's layers, lowest first: a module imports only from its own layer and those below it. Modules in no
# layer (the package roots, the command line, offline generation) sit above them all.
# The engine's own layers come first: its vocabulary; the machine it runs on; text and token ids; the kernels, the
# network's layers and the models; loading them; scheduling; sampling; and at its root the runner, the engines and
# the thread's loop, which tie them together.
ENGINE_LAYERS = (
    ("wsgi_infer.engine.config", "wsgi_infer.engine.sampling_params", "wsgi_infer.engine.outputs"),
    ("wsgi_infer.engine.runtime",),
    ("wsgi_infer.engine.text",),
    ("wsgi_infer.engine.kernels",),
    ("wsgi_infer.engine.layers",),
    ("wsgi_infer.engine.models",),
    ("wsgi_infer.engine.loading",),
    ("wsgi_infer.engine.scheduling",),
    ("wsgi_infer.engine.sampling",),
    ("wsgi_infer.engine",),
)
LAYERS = (
    *ENGINE_LAYERS,
    (
        "wsgi_infer.server.client_connection",
        "wsgi_infer.server.errors",
        "wsgi_infer.server.request_json",
        "wsgi_infer.server.query_numbers",
        "wsgi_infer.server.metrics",
        "wsgi_infer.server.master_reads",
        "wsgi_infer.server.settings",
        "wsgi_infer.server.model_specs",
    ),
    ("wsgi_infer.server.streaming",),
    ("wsgi_infer.server.engine_client",),
    ("wsgi_infer.server.tenants",),
    # the API: what every route shares, a conversation's path, then the routes and their API families
    (
        "wsgi_infer.server.api.access",
        "wsgi_infer.server.api.admission",
        "wsgi_infer.server.api.continuation",
        "wsgi_infer.server.api.serving",
        "wsgi_infer.server.api.bodies",
    ),
    ("wsgi_infer.server.api.chat",),
    ("wsgi_infer.server.api",),
    ("wsgi_infer.server.app", "wsgi_infer.server.wsgi"),
    ("wsgi_infer.server.gunicorn",),
)
# Plain data the server speaks to the engine with, and the text side's torch-free steps the front end runs on the
# engine's tokenizer (a chat's prompt, a prompt truncated, bad words, a token's text); routes use them freely.
ENGINE_VOCABULARY = (
    "wsgi_infer.engine",
    "wsgi_infer.engine.config",
    "wsgi_infer.engine.sampling_params",
    "wsgi_infer.engine.outputs",
    "wsgi_infer.engine.messages",
    "wsgi_infer.engine.text.bad_words",
    "wsgi_infer.engine.text.chat_template",
    "wsgi_infer.engine.text.token_pieces",
    "wsgi_infer.engine.text.truncation",
)
# Torch-free engine steps the gunicorn master starts before it forks workers: the CPU kernels' build where none are
# installed, and a process that reads GGUFs' text files ahead of their conversion (``text_files_ahead``).
MASTER_STEPS = (
    "wsgi_infer.engine.loading.gguf_config",
    "wsgi_infer.engine.loading.gguf_file",
    "wsgi_infer.engine.loading.gguf_header",
    "wsgi_infer.engine.loading.gguf_tokenizer",
    "wsgi_infer.engine.loading.model_paths",
    "wsgi_infer.engine.loading.resolved_config",
    "wsgi_infer.engine.loading.row_orders",
    "wsgi_infer.engine.loading.text_files",
    "wsgi_infer.engine.loading.vocabulary_merges",
    "wsgi_infer.engine.text.builtin_chat_templates",
    "wsgi_infer.engine.kernels",
    "wsgi_infer.engine.kernels.build",
    "wsgi_infer.engine.kernels.variants",
    "wsgi_infer.engine.runtime",
    "wsgi_infer.engine.runtime.cache_files",
    "wsgi_infer.engine.runtime.cpu_info",
    "wsgi_infer.engine.runtime.cpu_budget",  # and, in each worker, the threads the engine gets
)
NATIVE_THREADING = ("_thread", "_queue", "threading", "gevent.monkey", "gevent.threadpool", "concurrent.futures")


def plant(root: Path, files: dict[str, str]) -> None:
    """A copy of the package's tree in ``root`` with ``files`` (paths under wsgi_infer/) written into it."""
    for path in PACKAGE.rglob("*.py"):
        copy = root / path.relative_to(PACKAGE.parent)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    for relative, text in files.items():
        (root / "wsgi_infer" / relative).write_text(text)
