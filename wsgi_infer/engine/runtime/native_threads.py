"""The engine's helper threads and their queues, native even where gevent patched ``threading`` (the server's
workers): C ``SimpleQueue``s, which gevent never patches, and ``_thread``. In the server the bridge starts them
(``HubBridge.start_thread``: its threads' log records reach the hub); an engine without a server starts its own."""

from __future__ import annotations

import _thread
from _queue import Empty, SimpleQueue
from collections.abc import Callable

__all__ = ["Empty", "SimpleQueue", "start_native_thread"]


def start_native_thread(target: Callable[[], None]) -> None:
    _thread.start_new_thread(target, ())
