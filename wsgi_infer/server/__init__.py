"""The HTTP side: a Flask app under gunicorn's gevent worker, serving the engine.

Each worker's ``manager`` runs the engine on one native thread; ``bridge`` is
the one place that thread meets the gevent hub. The modules the gunicorn
master imports (``worker``, ``gunicorn_config``, ``gunicorn_logging``,
``settings``) import no torch, so the master stays small and forks fast.
"""
