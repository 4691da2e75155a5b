"""The one place where the engine's native thread meets the gevent hub.

gunicorn's gevent worker monkey-patches ``threading``: a ``threading.Thread``
would be a greenlet and a ``threading.Event`` a hub-only primitive. The engine
needs a genuine OS thread (torch work must never block the hub), and that
thread must hand results to greenlets in a way that wakes the hub. A
``HubBridge`` is that thread and both directions of its traffic:

- ``start_thread`` uses the original ``_thread.start_new_thread``.
- ``send`` (hub to thread) puts commands into a ``_queue.SimpleQueue`` (C,
  never patched): its blocking ``get`` is the native event the idle engine
  thread sleeps on, in ``commands``.
- ``post`` (thread to hub) appends to a ``deque`` and sends the hub loop's
  ``async_`` watcher, whose ``send()`` is thread-safe. Several sends before
  the hub runs coalesce into one callback, which drains the deque, so nothing
  is lost and a whole engine step costs one wake-up.
- The thread's log records go to the hub, which emits them, so the thread
  never touches logging's patched locks.

``call_on_hub`` is the way back: the native thread has a greenlet of the hub run
a call it must not make itself (an import) and waits for it on a ``SimpleQueue``.

``run_off_hub`` is the other native-thread door: a greenlet runs a call that
releases the GIL (tokenizing a prompt, compiling a grammar) on one OS thread
of the worker's own, the front-end thread, and waits cooperatively, so neither
the hub nor the engine thread stalls. It runs at a lower priority (nice 10), so
on a machine with few cores it takes what the engine leaves. Native work that the
steps leave a core for (``cpu_share.beside_the_steps``: a grammar vocabulary's
build) runs on a second thread at the engine's priority instead: at nice 10 it got
a tenth of a core beside any other busy process (3.3 s became 17-24 s).

One thread, not a pool: library code (jinja2's lexer cache, transformers'
logging setup) creates ``threading`` locks after the monkey-patching, so they
are gevent locks, and a gevent lock contended by two native threads can wait
for ever (shown in isolation; the likeliest cause of a chat request that hung
in the soak after a reload, when a pool compiled templates at once). Calls are
queued instead, as vLLM's tokenizer
executor does; each waits at most ``timeout`` seconds.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from _queue import SimpleQueue  # C implementation: never monkey-patched
from collections.abc import Callable, Iterator
from typing import Any

import gevent
from gevent._hub_local import get_hub_if_exists  # in its __all__; gevent.hub keeps it private
from gevent.monkey import get_original
from gevent.threadpool import ThreadPool

_start_new_thread = get_original("_thread", "start_new_thread")
_native_get_ident: Callable[[], int] = get_original("_thread", "get_ident")
_native_thread_id: Callable[[], int] = get_original("_thread", "get_native_id")
# The front-end thread: below the engine thread (nice 0), never starved. SCHED_IDLE starved pool threads under
# steady load: a prompt waited minutes for its tokens while both CPUs stepped (the soak's hung requests).
BACKGROUND_NICE = 10
_FRONT_END_THREADS: set[int] = set()  # the front-end thread: its log records go to the hub too
_busy_since: list[float] = []  # when the front-end thread's current call began
_front_end: dict[tuple[int, bool], ThreadPool] = {}  # per hub (one per worker) and priority: made in the hub
_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)

log = logging.getLogger(__name__)


class HubBridge:
    """A native thread and its link with the hub; ``handler`` gets every posted item, in the hub.

    Create, use and close it in the hub's thread; ``post`` and ``commands`` are
    for the native thread, ``send`` for any thread.
    """

    def __init__(self, handler: Callable[[Any], None], relay_loggers: tuple[str, ...] = ()) -> None:
        """Records that loggers under ``relay_loggers`` produce on the bridge's threads (and on the front-end
        thread of ``run_off_hub``) are handed to the hub (see ``_RelayFilter``)."""
        self._handler = handler
        self._items: collections.deque[Any] = collections.deque()
        self._commands: SimpleQueue = SimpleQueue()
        self._hub_ident = _native_get_ident()
        self._thread_idents: set[int] = set()  # the native threads started here
        self._closed = False
        self._watcher = gevent.get_hub().loop.async_()
        self._watcher.start(self._drain)
        self._watcher.ref = False  # never keeps the loop alive by itself
        if relay_loggers:
            _install_relay(_RelayFilter(self), relay_loggers)

    def start_thread(self, target: Callable[[], None]) -> None:
        """Any thread: run ``target`` on a new OS thread, even in a monkey-patched process (the engine thread
        starts its loader threads so). It touches no logging lock: a patched lock is the hub's."""

        def run() -> None:
            ident = _native_get_ident()
            self._thread_idents.add(ident)  # atomic under the GIL
            try:
                target()
            finally:
                self._thread_idents.discard(ident)
                # A patched primitive used here (transformers' from_pretrained makes a thread pool, whose queue is
                # gevent's) made this thread a hub of its own: its loop holds an epoll and an eventfd until
                # destroyed, two descriptors more for every model loaded.
                hub = get_hub_if_exists()
                if hub is not None:
                    hub.destroy(destroy_loop=True)

        _start_new_thread(run, ())

    def on_hub_thread(self) -> bool:
        return _native_get_ident() == self._hub_ident

    def relays_records_of(self, ident: int) -> bool:
        """Whether a record logged on thread ``ident`` goes to the hub through this bridge: its own threads', and
        the front-end thread's while the bridge is open (any open bridge of the process will do: one hub)."""
        return not self._closed and (ident in self._thread_idents or ident in _FRONT_END_THREADS)

    @staticmethod
    def run_off_hub(
        function: Callable[..., Any], *args: Any, timeout: float | None = None, beside_the_steps: bool = False
    ) -> Any:
        """In a greenlet: ``function(*args)`` on the front-end thread; its result, or its exception.
        TimeoutError once ``timeout`` seconds pass (queued behind others included); the call still runs.

        The thread runs at a lower priority, so on a machine with few cores the
        work takes what the engine thread leaves rather than slowing its steps.
        ``beside_the_steps``: on the thread at the engine's priority, for native work that the steps leave a core
        for and that touches no library lock (see the module's text).
        """
        result = _front_end_pool(beside_the_steps).spawn(_in_background, function, args, not beside_the_steps)
        try:
            value, error = result.get(timeout=timeout)
        except gevent.Timeout:
            raise TimeoutError(f"the front-end thread did not finish within {timeout:.0f} s") from None
        if error is not None:
            raise error
        return value

    # --- hub to thread --------------------------------------------------------------
    def send(self, command: Any) -> None:
        """Any thread: queue a command for the native thread."""
        self._commands.put(command)

    def commands(self, block: bool) -> Iterator[Any]:
        """Native thread: every queued command; with ``block``, sleep until the first one."""
        if block:
            yield self._commands.get()
        while not self._commands.empty():
            yield self._commands.get_nowait()

    # --- thread to hub --------------------------------------------------------------
    def call_on_hub(self, function: Callable[..., Any], *args: Any) -> Any:
        """Native thread: ``function(*args)`` in a greenlet of the hub, waited for natively; its result, or its
        exception. For what the native thread must not do itself: import (gevent's patched locks guard imports and
        the loggers they create). On the hub's own thread, or once the bridge is closed, the call runs here."""
        if self.on_hub_thread() or self._closed:
            return function(*args)
        reply: SimpleQueue = SimpleQueue()
        self.post(_HubCall(function, args, reply))
        value, error = reply.get()
        if error is not None:
            raise error
        return value

    def post(self, item: Any) -> None:
        """Thread-safe: queue ``item`` and wake the hub."""
        self._items.append(item)
        self._watcher.send()

    def _drain(self) -> None:
        while self._items:
            item = self._items.popleft()
            try:
                if isinstance(item, logging.LogRecord):
                    logging.getLogger(item.name).handle(item)  # as if it had been logged here
                elif isinstance(item, _HubCall):
                    gevent.spawn(item.run)  # in a greenlet: the hub's own loop callback must not block
                else:
                    self._handler(item)
            except Exception:  # one bad item must not stop delivery of the rest
                log.exception("bridge handler failed")

    def close(self) -> None:
        self._closed = True
        self._drain()
        self._watcher.stop()
        self._watcher.close()


class _HubCall:
    """A native thread's call for the hub (``call_on_hub``), and where its result goes."""

    def __init__(self, function: Callable[..., Any], args: tuple, reply: SimpleQueue) -> None:
        self.function, self.args, self.reply = function, args, reply

    def run(self) -> None:
        self.reply.put(_returned(self.function, self.args))


def front_end_busy_for() -> float:
    """Seconds the front-end thread has spent on its current call (0 when idle): a stuck call shows here."""
    return time.monotonic() - _busy_since[0] if _busy_since else 0.0


def _front_end_pool(beside_the_steps: bool) -> ThreadPool:
    hub = gevent.get_hub()
    pool = _front_end.get((id(hub), beside_the_steps))
    if pool is None:  # its thread is started by the hub's: nice 0, as the hub's
        pool = _front_end[(id(hub), beside_the_steps)] = ThreadPool(1, hub=hub)
    return pool


def start_front_end() -> None:
    """Both front-end threads started now, in the hub, not at their first calls: every thread a worker keeps runs
    once it is ready (the soak counts them to find threads that models coming and going left behind)."""
    for beside_the_steps in (False, True):
        _front_end_pool(beside_the_steps).spawn(_in_background, _nothing, (), not beside_the_steps)


def _nothing() -> None:
    pass


def _in_background(function: Callable[..., Any], args: tuple, front_end: bool) -> tuple[Any, Exception | None]:
    _FRONT_END_THREADS.add(_native_get_ident())  # its log records go to the hub (a set's add is atomic under the GIL)
    if not front_end:  # native work beside the steps: at the engine's priority, bounded, no stall of the front end
        return _returned(function, args)
    try:  # Linux: a thread's own nice value (no-op where it is already set or not allowed)
        os.setpriority(os.PRIO_PROCESS, _native_thread_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
    _busy_since.append(time.monotonic())
    try:
        return _returned(function, args)
    finally:
        _busy_since.clear()


def _returned(function: Callable[..., Any], args: tuple) -> tuple[Any, Exception | None]:
    """An exception comes back as a value: gevent's pool printed the traceback of each one raised there (a client's
    constraint that does not compile, a 400), and the caller raises it again."""
    try:
        return function(*args), None
    except Exception as exc:
        return None, exc


class _RelayFilter(logging.Filter):
    """On the engine thread and the front-end thread (which tokenizes: transformers warns there of a prompt longer
    than the tokenizer's own limit), forward a record to the hub instead of handling it there.

    Logger filters run before any handler lock is taken, so no native thread ever touches a (patched) handler
    lock: a gevent lock that two native threads contend for can wait for ever (the soak's hung requests, once
    tokenizing left the engine thread).
    """

    def __init__(self, bridge: HubBridge) -> None:
        super().__init__()
        self._bridge = bridge

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._bridge.relays_records_of(_native_get_ident()):
            return True
        self._bridge.post(record)
        return False


def _install_relay(relay: _RelayFilter, prefixes: tuple[str, ...]) -> None:
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    for name in {*names, *prefixes}:
        logger = logging.getLogger(name)
        logger.addFilter(relay)
        for level in _LEVELS:
            logger.isEnabledFor(level)  # warm the level cache: a miss takes logging's module lock
