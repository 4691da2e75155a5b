"""What the master reads of the settings' files (the models config, the keys file) for its workers, at start and at
each SIGHUP (``master_reads``). Apart from ``config``, whose import makes the server's folders: a test reads here."""

from __future__ import annotations

import logging

from wsgi_infer.server.master_reads import read_for_workers
from wsgi_infer.server.settings import ServerSettings
from wsgi_infer.server.tenants.keys import read_keys


def read_for_workers_now(settings: ServerSettings, reloading: bool = False) -> list:
    """The models and keys the settings' files give, read for the workers to come; the keys. ``reloading``: a
    model's path that names nothing is refused (at start, its worker says so; at a reload, the new workers failed
    to boot once the old ones had drained, and gunicorn stopped the server)."""
    from wsgi_infer.server.model_specs import ModelsConfigError, read_model_specs  # as text_files_ahead's: the master's

    def models() -> list:
        specs = read_model_specs(settings)
        for spec in specs if reloading else ():
            if not spec.files.exists():
                raise ModelsConfigError(f"model {spec.name}: {spec.files}: no such file or directory")
        return specs

    read_for_workers("models", settings.model_dump_json(), models)
    key_inputs = (tuple(settings.api_keys), settings.keys_file)
    return read_for_workers("keys", key_inputs, lambda: read_keys(settings.api_keys, settings.keys_file))


def read_again(log: logging.Logger) -> None:
    """On SIGHUP: the files read again. Where an edit broke one, one line says why, and the new workers keep what
    was read before."""
    try:
        read_for_workers_now(ServerSettings(), reloading=True)
    except ValueError as exc:  # pydantic's ValidationError is one
        log.error("%s; the new workers keep what was read before: fix it, then reload again", exc)
    except Exception:  # a reload never stops the server (a TypeError did: the master's main loop died)
        log.exception("the files could not be read again; the new workers keep what was read before")
