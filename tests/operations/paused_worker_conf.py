"""gunicorn.conf.py, but each worker stops itself (SIGSTOP) right after our post_fork, before gunicorn sets its
signal handlers: a test can then signal the server while the worker is in that window, for sure."""

import os
import signal

from wsgi_infer.server.gunicorn.config import *  # noqa: F401,F403
from wsgi_infer.server.gunicorn.config import post_fork as serving_post_fork


def post_fork(server, worker):
    serving_post_fork(server, worker)
    os.kill(os.getpid(), signal.SIGSTOP)
