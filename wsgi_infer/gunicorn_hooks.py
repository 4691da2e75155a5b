"""What gunicorn.conf.py's server hooks do, kept in the package."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_environment() -> None:
    """Runs in the master when the config is read, before any worker or torch import."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.environ.get(METRICS_DIR_ENV):
        os.environ[METRICS_DIR_ENV] = tempfile.mkdtemp(prefix="wsgi-infer-metrics-")
        os.environ["WSGI_INFER_OWNS_METRICS_DIR"] = "1"


def post_worker_init(worker) -> None:
    """In the worker, after gevent patched it: start the engine thread (it loads the model)."""
    _share_gunicorn_logging(worker)
    worker.wsgi.extensions["wsgi_infer"].start()


def _share_gunicorn_logging(worker) -> None:
    """Our loggers write through gunicorn's error log, at its level (--log-level)."""
    error_log = worker.log.error_log
    for name, level in (("wsgi_infer", error_log.level), ("transformers", max(error_log.level, logging.WARNING))):
        logger = logging.getLogger(name)
        logger.handlers = list(error_log.handlers)
        logger.setLevel(level)
        logger.propagate = False


def worker_exit(server, worker) -> None:
    app = getattr(worker, "wsgi", None)
    if app is not None and hasattr(app, "extensions"):  # in the worker, with the app loaded
        app.extensions["wsgi_infer"].close()


def child_exit(server, worker) -> None:
    from . import metrics

    metrics.mark_worker_dead(worker.pid)


def on_exit(server) -> None:
    if os.environ.get("WSGI_INFER_OWNS_METRICS_DIR"):
        shutil.rmtree(os.environ[METRICS_DIR_ENV], ignore_errors=True)
