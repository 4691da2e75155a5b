"""The one place where the engine's native thread meets the gevent hub.

gunicorn's gevent worker monkey-patches ``threading``: a ``threading.Thread``
would be a greenlet and a ``threading.Event`` a hub-only primitive. The engine
needs a genuine OS thread (torch work must never block the hub), and that
thread must hand results to greenlets in a way that wakes the hub:

- ``start_native_thread`` uses the original ``_thread.start_new_thread``.
- ``HubBridge.post`` (any thread) appends to a ``deque`` and sends the hub
  loop's ``async_`` watcher, whose ``send()`` is thread-safe. Several sends
  before the hub runs coalesce into one callback, which drains the deque, so
  nothing is lost and a whole engine step costs one wake-up.
- ``_queue.SimpleQueue`` (C, never patched) carries commands the other way:
  its blocking ``get`` is the native event the idle engine thread sleeps on.
- ``relay_native_logs`` keeps the thread away from logging's patched locks by
  sending its log records to the hub, which emits them.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import gevent
from gevent.monkey import get_original

_start_new_thread = get_original("_thread", "start_new_thread")
native_get_ident: Callable[[], int] = get_original("_thread", "get_ident")


def start_native_thread(target: Callable[[], None]) -> None:
    """Run ``target`` on a new OS thread, even in a monkey-patched process."""
    _start_new_thread(target, ())


class HubBridge:
    """Delivers items posted from any thread to ``handler``, called in the hub.

    Create, use and close it in the hub's thread; only ``post`` may be called
    from elsewhere.
    """

    def __init__(self, handler: Callable[[Any], None]) -> None:
        self._handler = handler
        self._items: collections.deque[Any] = collections.deque()
        self._watcher = gevent.get_hub().loop.async_()
        self._watcher.start(self._drain)
        self._watcher.ref = False  # never keeps the loop alive by itself

    def post(self, item: Any) -> None:
        """Thread-safe: queue ``item`` and wake the hub."""
        self._items.append(item)
        self._watcher.send()

    def _drain(self) -> None:
        while self._items:
            item = self._items.popleft()
            try:
                self._handler(item)
            except Exception:  # one bad item must not stop delivery of the rest
                logging.getLogger(__name__).exception("bridge handler failed")

    def close(self) -> None:
        self._drain()
        self._watcher.stop()
        self._watcher.close()


class _RelayFilter(logging.Filter):
    """On the native thread, forward a record to the hub instead of handling it there."""

    def __init__(self, thread_ident: Callable[[], int | None], bridge: HubBridge) -> None:
        super().__init__()
        self._thread_ident = thread_ident
        self._bridge = bridge

    def filter(self, record: logging.LogRecord) -> bool:
        if native_get_ident() != self._thread_ident():
            return True
        self._bridge.post(record)
        return False


def relay_native_logs(thread_ident: Callable[[], int | None], bridge: HubBridge, prefixes: tuple[str, ...]) -> None:
    """Make loggers under ``prefixes`` hand the native thread's records to the hub.

    Logger filters run before any handler lock is taken, so the native thread
    never touches a (patched) handler lock. The hub re-emits relayed records
    with ``emit_relayed``.
    """
    relay = _RelayFilter(thread_ident, bridge)
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    for name in {*names, *prefixes}:
        logger = logging.getLogger(name)
        logger.addFilter(relay)
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL):
            logger.isEnabledFor(level)  # warm the level cache: a miss takes logging's module lock


def emit_relayed(record: logging.LogRecord) -> None:
    """Handle a relayed record in the hub, as if it had been logged here."""
    logging.getLogger(record.name).handle(record)
