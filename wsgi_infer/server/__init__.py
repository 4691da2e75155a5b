"""The HTTP side: a Flask app under gunicorn's gevent worker, serving the engine.

Its parts, each a package that imports only those listed before it:

- ``errors``, ``metrics``, ``settings``: the OpenAI error shape, the
  Prometheus metrics and the ``WSGI_INFER_*`` settings, used throughout;
- ``streaming/``: resumable streams (the SSE wire format, each response's
  event log, its Redis copy);
- ``engine_client/``: a worker's way to its engine thread (``bridge``, the one
  place that thread meets the gevent hub; ``manager``, ``router``, the
  requests' ``streams``);
- ``api/``: the routes: what they share, a conversation's path (``chat/``) and
  one package per API family (``openai/``, ``responses/``, ``messages/``);
- ``app``: the Flask app factory (``wsgi`` for gunicorn's ``app_uri``);
- ``gunicorn/``: the worker class, the hooks and the log format. What the
  gunicorn master imports (``gunicorn/``, ``settings``) imports no torch, so
  the master stays small and forks fast.
"""
