"""The gunicorn integration: the gevent worker class, the server hooks (``config``) and the access-log format
(``logger``). The gunicorn master imports these, so they import no torch."""
