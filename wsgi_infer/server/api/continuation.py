"""A stream continued here after the host generating it died (several hosts sharing a Redis).

A resume that finds a stream in Redis whose producer lease lapsed before its end takes the lease over
(``RedisStore.claim``: one host continues it; a resume elsewhere follows this host's copy) and runs the stream's
request again here, as it came (its path and body, from the stream's record), under the resuming client's own
credentials, with two differences. The response draws the same ids (``ResponseIdentity``); and the engine is given
the tokens the stream had generated, which it computes again with the prompt (from the KV store where it has them),
while the route first reads the batches of output the stream had taken. So the route writes the events the client
has (``StreamLogs`` checks them), then the rest: greedy or seeded, the text is the uninterrupted run's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

from flask import Flask, current_app, g, request
from werkzeug.test import EnvironBuilder

from ..engine_client.delta_records import decode_batch
from ..engine_client.extension import manager_of
from ..engine_client.identity import ResponseIdentity
from ..engine_client.streams import ChoiceDelta
from ..errors import APIError
from ..streaming.log_shapes import Continuer
from ..streaming.stream_log import StreamLog, StreamLogs

log = logging.getLogger(__name__)

CREDENTIALS = ("Authorization", "x-api-key")  # the resuming client's, which the request runs under again


@dataclass
class Continuation:
    """What the request run again here is told (``serving.start`` and ``publish_log`` read it from ``g``)."""

    key: str  # the stream's id as kept (under its API key)
    recorded: list[str]  # the output it had taken, batch by batch, as JSON (``delta_records``)
    known: list[str]  # the events it had written
    log: StreamLog | None = None  # its log here, once published

    @cached_property
    def batches(self) -> list[list[ChoiceDelta]]:
        return [decode_batch(batch) for batch in self.recorded]

    def generated(self, num_choices: int) -> list[list[int] | None]:
        """Per choice, the tokens it had generated; None for one that had ended."""
        tokens: list[list[int] | None] = [[] for _ in range(num_choices)]
        for choice in (choice for batch in self.batches for choice in batch):
            if tokens[choice.index] is not None:
                tokens[choice.index] += choice.delta.token_ids
            if choice.delta.finish_reason is not None:
                tokens[choice.index] = None
        return tokens


def continuer(key: str) -> Continuer:
    """In a resuming request: how to continue the stream kept under ``key`` here, should its host be gone."""
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    credentials = {name: request.headers[name] for name in CREDENTIALS if name in request.headers}
    return lambda after: _continue(app, key, credentials, after)


def _continue(app: Flask, key: str, credentials: dict[str, str], after: int) -> StreamLog | None:
    stream_logs = manager_of(app).stream_logs
    claimed = stream_logs.store.claim(key)
    if claimed is None:
        return None
    record, batches, known = claimed
    if after > len(known):  # sent while Redis was away: where the events after Redis's copy ended is unknown
        return _failed(stream_logs, key, f"its client has {after} events, Redis only {len(known)}")
    log.info("stream %s: its host is gone; continuing it here after %d events", key, len(known))
    headers = {**credentials, "X-Request-Id": record.request_id, "Content-Type": "application/json"}
    builder = EnvironBuilder(record.path, method="POST", data=record.body, headers=headers)
    continuation = Continuation(key, batches, known)
    holding = stream_logs.store.hold(key)
    with app.request_context(builder.get_environ()):
        g.identity, g.continuation = ResponseIdentity(record.seed, record.created), continuation
        try:
            refused = app.preprocess_request()
            reason = f"its request was refused ({refused.status})" if refused else ""
            if not refused:
                app.dispatch_request()
        except APIError as exc:  # its model is not served here, a limit, the engine stopping
            reason = f"{exc.status}: {exc.message}"
        except Exception as exc:
            log.exception("stream %s: continuing it failed", key)
            reason = repr(exc)
        finally:
            holding.kill()  # its mirror renews the lease from here
    if continuation.log is None:
        return _failed(stream_logs, key, reason)
    stream_logs.metrics.streams_continued("continued").inc()
    return continuation.log


def _failed(stream_logs: StreamLogs, key: str, reason: str) -> None:
    log.warning("stream %s: could not be continued here: %s", key, reason)
    stream_logs.metrics.streams_continued("failed").inc()
    stream_logs.store.give_up(key)  # its reader (here or elsewhere) ends now, as it would have
