"""gunicorn settings and server hooks for wsgi-infer.

The top-level gunicorn.conf.py imports everything from here, so
`gunicorn -c gunicorn.conf.py` and `wsgi-infer serve` (which loads this module
as `python:wsgi_infer.server.gunicorn.config`) run the same configuration.
Command-line flags and GUNICORN_CMD_ARGS override these settings; the engine
is configured by WSGI_INFER_* variables (docs/operations.md).
"""

import gc
import logging
import os
import sys
import time

from gunicorn.arbiter import Arbiter
from pydantic import ValidationError

from wsgi_infer.engine.kernels.build import start_building_cpu_kernels
from wsgi_infer.engine.runtime.cpu_budget import cpu_budget
from wsgi_infer.server.engine_client.extension import manager_of
from wsgi_infer.server.gunicorn.owned_dirs import make_owned_dir, remove_abandoned_dirs, remove_owned_dirs
from wsgi_infer.server.gunicorn.settings_files import read_again, read_for_workers_now
from wsgi_infer.server.gunicorn.text_files_ahead import start_text_files_ahead
from wsgi_infer.server.gunicorn.worker import InferenceWorker
from wsgi_infer.server.settings import ServerSettings, named_problems, unknown_variables
from wsgi_infer.server.tenants.local_store import LocalLimitStore

# Read in the master before any worker exists (and before torch is imported anywhere).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = make_owned_dir("wsgi-infer-metrics-")
    os.environ["WSGI_INFER_OWNS_METRICS_DIR"] = "1"
if not os.environ.get("WSGI_INFER_LIMITS_DIR"):  # the API keys' limits, which every worker counts against
    os.environ["WSGI_INFER_LIMITS_DIR"] = make_owned_dir("wsgi-infer-limits-")
    os.environ["WSGI_INFER_OWNS_LIMITS_DIR"] = "1"
LocalLimitStore.prepare(os.environ["WSGI_INFER_LIMITS_DIR"])

wsgi_app = "wsgi_infer.server.wsgi:app"
bind = "127.0.0.1:8000"
workers = 1
worker_class = "wsgi_infer.server.gunicorn.worker.InferenceWorker"  # gunicorn's gevent worker, with a drain
# Connections per worker (one greenlet each, idle keep-alive ones included); past it a JSON 503.
# Measured: 12 KB of worker RSS per idle connection, 27 KB per open queued stream (docs/operations.md).
worker_connections = 10000
timeout = 60  # the hub never runs model work, so this only fires on a hung worker
graceful_timeout = 30
keepalive = 5  # idle connections, and request headers, get this long (bodies: body_timeout_seconds)
accesslog = "-"
# gunicorn's own format, then the time to the response's last byte and the request id that ties the line to the
# response (its X-Request-Id) and to the lines this server logs of that request
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" %(M)sms %({x-request-id}o)s'
logger_class = "wsgi_infer.server.gunicorn.logger.ProxyAwareLogger"  # real client address behind nginx
errorlog = "-"
loglevel = "info"


def on_starting(server):
    """In the master, before any worker: start compiling the CPU kernels if this machine has none yet, and reading
    the text files of GGUFs not yet converted (``text_files_ahead``), where a second CPU lets them run beside the
    workers' imports. Each runs while the workers import; their engine threads wait for it on its lock. A gevent
    worker could not run them: its engine thread cannot wait for a child process. And the folders of servers killed
    outright are removed (``owned_dirs``)."""
    _settings_or_exit(server)
    abandoned = remove_abandoned_dirs()
    if abandoned:
        server.log.info("removed %d folders left by servers killed outright: %s", len(abandoned), " ".join(abandoned))
    _control_socket_of_our_own(server)
    start_building_cpu_kernels()
    start_text_files_ahead()


def _settings_or_exit(server):
    """The settings, checked before any worker imports torch: a bad one is a line naming its variable, and gunicorn's
    boot-error exit, where each worker printed pydantic's traceback seconds later, naming the field. A variable that
    is no setting is named too (a misspelt one was ignored without a word)."""
    for name, nearest in unknown_variables(os.environ):
        server.log.warning("%s is no setting of wsgi-infer, ignored%s", name, f": {nearest}?" if nearest else "")
    try:
        _check_gunicorn_flags(server)
        settings = ServerSettings()
        server.log.info("settings given: %s", settings.given() or "none (every default)")
        keys = read_for_workers_now(settings)  # else each worker's traceback, once it imported torch
        if settings.api_key is not None and not settings.api_keys:
            server.log.warning("WSGI_INFER_API_KEY is set but holds no key: the API is open to anyone")
        if settings.protect_ops and not keys:
            server.log.warning("WSGI_INFER_PROTECT_OPS does nothing without API keys: /health and /metrics are open")
        if server.cfg.workers > 1 and not settings.redis_url:
            server.log.warning(
                "%d workers and no WSGI_INFER_REDIS_URL: a stream resumes, and a stored response continues, only on "
                "the worker that made it (another answers 404, or 400 previous_response_not_found)",
                server.cfg.workers,
            )
    except ValidationError as exc:
        for line in named_problems(exc):
            server.log.error("%s", line)
    except ValueError as exc:  # a models config's, a setting every model takes, or the keys file's
        server.log.error("%s", exc)
    else:
        return
    remove_owned_dirs()
    sys.exit(Arbiter.WORKER_BOOT_ERROR)


def on_reload(server):
    """In the master, on SIGHUP, before the new workers fork: the settings' files read again (``settings_files``)."""
    read_again(server.log)


def _check_gunicorn_flags(server) -> None:
    """gunicorn's flags passed through that would serve no engine, or hang every client: a ValueError saying why. A
    sync worker's /health said "loading" for ever; zero workers listened and never answered; a preloaded app
    imports torch in the master, which then forks it."""
    cfg = server.cfg
    if cfg.worker_class_str != worker_class:
        raise ValueError(f"--worker-class {cfg.worker_class_str}: wsgi-infer serves on its own worker ({worker_class})")
    if cfg.workers < 1:
        raise ValueError(f"--workers {cfg.workers}: at least 1 worker serves")
    if cfg.worker_connections < 1:  # every request, /health's, was a 503 too_many_connections
        raise ValueError(f"--worker-connections {cfg.worker_connections}: a worker serves 1 connection at least")
    if cfg.preload_app:
        raise ValueError("--preload would import torch in the master before it forks: wsgi-infer's workers load it")
    if cfg.graceful_timeout < cfg.keepalive + 3:
        server.log.warning(
            "--graceful-timeout %g is less than the keep-alive (%g s) and 3 s: a stop drains for 1 s at most, and "
            "streams the master kills end without their terminal event",
            *(cfg.graceful_timeout, cfg.keepalive),
        )


def _control_socket_of_our_own(server):
    """gunicorn (25.1 on) opens a control socket at one path per user ($XDG_RUNTIME_DIR/gunicorn.ctl, else
    ~/.gunicorn/gunicorn.ctl): two servers of one user share it, the last started takes it and the first stopped
    removes it. So a server opens one only at a path named for it (--control-socket PATH); signals control it."""
    setting = server.cfg.settings.get("control_socket")
    if setting is not None and setting.get() == setting.default:
        server.cfg.set("control_socket_disable", True)


def pre_fork(server, worker):
    """In the master: give the new worker the lowest index no live worker has (device pinning)."""
    taken = {getattr(w, "wsgi_infer_index", None) for w in server.WORKERS.values()}
    worker.wsgi_infer_index = next(i for i in range(len(taken) + 1) if i not in taken)


def post_fork(server, worker):
    """In the new worker, before it imports anything: no cyclic garbage collection while it imports torch,
    transformers and the app. Their hundreds of thousands of objects live as long as the worker, yet their
    allocation triggered some 500 collections that traversed them again and again (0.1-0.8 s of a start). And a
    stop that reaches the worker before its own signal handlers exist is kept for them (``keep_early_stops``)."""
    gc.disable()
    worker.wsgi_infer_forked_at = time.monotonic()
    if isinstance(worker, InferenceWorker):
        worker.keep_early_stops(server.SIG_QUEUE)


def post_worker_init(worker):
    """In the worker, after gevent patched it and the app is imported: collections resume, without the imported
    objects (frozen: no collection looks at them again), then the engine thread starts (it loads the model)."""
    gc.freeze()
    gc.enable()
    forked_at = getattr(worker, "wsgi_infer_forked_at", None)  # None where a config replaced our post_fork
    if forked_at is not None:
        imported_in, frozen = time.monotonic() - forked_at, gc.get_freeze_count()
        worker.log.info("imported in %.1f s; %d objects frozen out of garbage collection", imported_in, frozen)
    _share_gunicorn_logging(worker)
    manager = manager_of(worker.wsgi)
    settings = manager.settings
    _place_engine(worker, settings)
    worker.drain_seconds = _drain_seconds(worker, settings.drain_seconds)

    def replace_worker():  # the engine thread died: let gunicorn start a fresh worker
        worker.log.error("engine thread died; this worker exits and gunicorn replaces it")
        worker.alive = False

    def stop_serving(reason: str):  # gunicorn's convention for a worker that cannot boot: exit code 3
        if not settings.serve_load_failure:
            worker.log.error("this worker exits with code 3, gunicorn stops (WSGI_INFER_SERVE_LOAD_FAILURE=1: 503s)")
            worker.boot_failure = reason
            worker.alive = False

    manager.on_engine_death = replace_worker
    manager.on_load_failure = stop_serving
    manager.loads.set_workers(worker.cfg.workers)  # the default memory budget is a share per worker
    manager.start()


def worker_exit(server, worker):
    manager = manager_of(getattr(worker, "wsgi", None))
    if manager is not None:  # in the worker, with the app loaded
        manager.close()
        _exit_now()


def _exit_now() -> None:
    """Leave with the exit code gunicorn is raising, logs flushed, but without the interpreter's teardown: freeing
    torch's and transformers' module graphs takes 0.5 s of a quick stop, and twice that beside busy processes,
    only to free memory the process's end frees anyway."""
    leaving = sys.exc_info()[1]  # this hook runs in gunicorn's `finally` around the worker
    if not isinstance(leaving, SystemExit):
        return
    code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def child_exit(server, worker):
    from wsgi_infer.server import metrics

    metrics.mark_worker_dead(worker.pid)


def on_exit(server):
    remove_owned_dirs()


def _place_engine(worker, settings):
    """Workers share the machine: worker i on CUDA device i mod count, the CPUs this process may use split
    evenly."""
    import torch

    index = getattr(worker, "wsgi_infer_index", 0)
    if settings.device in ("auto", "cuda") and torch.cuda.is_available():
        settings.device = f"cuda:{index % torch.cuda.device_count()}"
        worker.log.info("worker %d uses %s", index, settings.device)
    elif not settings.device.startswith("cuda"):
        budget = cpu_budget()  # the affinity mask and cgroup quota, as the JVM and Go runtimes read them
        threads = max(1, budget.threads // worker.cfg.workers)
        torch.set_num_threads(threads)
        worker.log.info("worker %d uses the CPU with %d threads (%s)", index, threads, budget.reason)


def _share_gunicorn_logging(worker):
    """Our loggers write through gunicorn's error log, at its level (--log-level), unless a log config
    (``--log-config``, ``--log-config-dict``, ``--log-config-json``) said where they go."""
    if worker.cfg.logconfig or worker.cfg.logconfig_dict or worker.cfg.logconfig_json:
        return
    error_log = worker.log.error_log
    for name, level in (("wsgi_infer", error_log.level), ("transformers", max(error_log.level, logging.WARNING))):
        logger = logging.getLogger(name)
        logger.handlers = list(error_log.handlers)
        logger.setLevel(level)
        logger.propagate = False


def _drain_seconds(worker, asked: float | None) -> float:
    """How long a drain lets open requests finish. By default graceful_timeout less the keep-alive and 2 s (idle
    kept-alive connections close before the master's kill); asked for, at most graceful_timeout less 2 s, in which
    the streams still open get their terminal events: a longer drain was cut by the kill, its streams with none."""
    most, cfg = max(1.0, worker.cfg.graceful_timeout - 2), worker.cfg
    if asked is None:
        return max(1.0, cfg.graceful_timeout - cfg.keepalive - 2)
    if asked > most:
        worker.log.warning(
            "WSGI_INFER_DRAIN_SECONDS=%g is past gunicorn's graceful_timeout (%g s) less 2 s: draining %g s "
            "(raise --graceful-timeout for more)",
            asked,
            cfg.graceful_timeout,
            most,
        )
    return min(asked, most)
