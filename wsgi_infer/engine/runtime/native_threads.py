"""The engine's helper threads and their queues, native even where gevent patched ``threading`` (the server's
workers): C ``SimpleQueue``s, which gevent never patches, and ``_thread``. In the server the bridge starts them
(``HubBridge.start_thread``: its threads' log records reach the hub); an engine without a server starts its own.
What such a thread must not do itself, import (gevent's patched locks guard the imports and the loggers they
create), it has done by whom the server names (``set_importer``)."""

from __future__ import annotations

import _thread
import importlib
import sys
from _queue import Empty, SimpleQueue
from collections.abc import Callable

__all__ = [
    "Empty",
    "SimpleQueue",
    "call_on_importer",
    "import_modules",
    "import_for_thread",
    "set_importer",
    "start_native_thread",
    "start_openmp_team",
]


def start_native_thread(target: Callable[[], None]) -> None:
    _thread.start_new_thread(target, ())


def start_openmp_team() -> None:
    """The calling thread's OpenMP team started now, as wide as torch's: OpenMP starts it at the thread's first
    parallel region, which a small model's steps may reach minutes after the worker is ready."""
    import torch

    torch.ones(1 << 16).add_(1)  # 2 of torch's grains: a parallel region of every thread


def import_modules(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)


def _call(function: Callable[..., None], *args: object) -> None:
    function(*args)


_importer: Callable[..., None] = _call


def set_importer(importer: Callable[..., None]) -> None:
    """Who imports what a load needs beyond what was imported before it (``importer(function, *args)`` calls the
    function that imports): the server's hub, for its engine thread; by default the calling thread."""
    global _importer
    _importer = importer


def call_on_importer(function: Callable[..., None], *args: object) -> None:
    """``function(*args)``, which imports, called by the importer."""
    _importer(function, *args)


def import_for_thread(modules: tuple[str, ...]) -> None:
    """``modules`` imported by the importer, where any is not yet."""
    if not all(module in sys.modules for module in modules):
        _importer(import_modules, modules)
