"""`gunicorn -c gunicorn.conf.py` serves wsgi-infer: gevent worker, engine hooks.

The settings and hooks live in the package (wsgi_infer/server/gunicorn/config.py)
so that `wsgi-infer serve` runs the very same configuration.
"""

from wsgi_infer.server.gunicorn.config import *  # noqa: F401,F403
