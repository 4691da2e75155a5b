"""gunicorn settings for wsgi-infer: `gunicorn -c gunicorn.conf.py`.

Command-line flags and GUNICORN_CMD_ARGS override these; the engine itself is
configured by WSGI_INFER_* variables (see the README).
"""
from wsgi_infer import gunicorn_hooks

gunicorn_hooks.prepare_environment()

wsgi_app = "wsgi_infer.wsgi:app"
bind = "127.0.0.1:8000"
workers = 1
worker_class = "gevent"
worker_connections = 1000  # greenlets per worker, idle keep-alive connections included
timeout = 60  # heartbeat: the hub never runs model work, so this only fires on a hung worker
graceful_timeout = 30
keepalive = 5
accesslog = "-"
errorlog = "-"
loglevel = "info"

post_worker_init = gunicorn_hooks.post_worker_init
worker_exit = gunicorn_hooks.worker_exit
child_exit = gunicorn_hooks.child_exit
on_exit = gunicorn_hooks.on_exit
