"""The folders a server's master made for its workers (metrics, limits), removed when it exits: by gunicorn's exit
hook, or by ``wsgi-infer serve`` where gunicorn's halt ended before the hook ran. Nothing else imported here: the
command line reaches it without gevent."""

from __future__ import annotations

import os
import shutil


def remove_owned_dirs() -> None:
    if os.environ.get("WSGI_INFER_OWNS_METRICS_DIR"):
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
    if os.environ.get("WSGI_INFER_OWNS_LIMITS_DIR"):
        shutil.rmtree(os.environ["WSGI_INFER_LIMITS_DIR"], ignore_errors=True)
