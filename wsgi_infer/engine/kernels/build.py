"""Which CPU kernels library a process loads: the installed variant for its CPU, or one built here.

``pip install`` builds the kernels in one variant per x86-64 level (``variants.py``); a process loads the best
its CPU runs, and nothing compiles at start. A source tree whose C sources changed since its install (a
developer's editable install), or a package installed without a compiler, builds for this very CPU
(``-march=native``) into the user cache instead, once: the gunicorn master starts that build in a child process
before it forks workers (``on_starting``), because a gevent worker cannot wait for a child process from its engine
thread; the child holds the build's lock, and workers wait on it (``kernels_library``). A build that failed is
remembered, not retried at every start. Imports no torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from contextlib import AbstractContextManager
from functools import cache
from pathlib import Path

from ..runtime.cache_files import cache_root, file_lock
from ..runtime.cpu_info import cpu_flags, cpu_model_name
from . import variants

log = logging.getLogger(__name__)

KERNELS_DIR = "kernels"  # in the cache root
NATIVE = ("-march=native",)


def library_path() -> Path:
    """Where a build for this source, its flags and this CPU (its model and instruction sets) lives."""
    cpu = f"{cpu_model_name()} {' '.join(sorted(cpu_flags()))}"
    flags = " ".join(variants.COMMON_FLAGS + NATIVE)
    key = hashlib.sha256(b"\0".join([variants.source_bytes(), flags.encode(), cpu.encode()]))
    return cache_root() / KERNELS_DIR / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def installed_dir() -> Path:
    """Where the installed variants are: the package's own, or ``WSGI_INFER_KERNELS_DIR``."""
    return Path(os.environ.get("WSGI_INFER_KERNELS_DIR") or variants.INSTALLED)


@cache
def _installed(directory: Path) -> Path | None | bool:
    """The installed variant to load from ``directory``; None where one is installed for this source but none runs
    on this CPU; False where none is installed for this source (then a build serves)."""
    names = variants.installed_variants(directory)
    if names is None:
        if os.environ.get("WSGI_INFER_KERNELS_DIR"):  # a wrong path was a silent build: 10 s more at each start
            log.warning("WSGI_INFER_KERNELS_DIR %s holds no CPU kernels of this source: they are built", directory)
        return False
    best = next(iter(variants.runnable(names, cpu_flags())), None)
    if best is None:
        log.warning("no installed CPU kernels variant (of %s) runs on this CPU: torch ops serve", ", ".join(names))
        return None
    log.info("CPU kernels: the installed %s variant", best.name)
    return directory / best.file_name()


def kernels_library(build: bool = False) -> Path | None:
    """The library this process loads, or None (torch's ops serve). Without an installed variant: the build for
    this CPU, once no process is building it any more, or (``build``) built now."""
    installed = _installed(installed_dir())
    if installed is not False:
        return installed
    target = library_path()
    return build_cpu_kernels() if build else _after_any_build(target)


def kernels_library_now() -> Path | None:
    """The library where one is there now (installed, or built for this CPU), or None: for a process that wants
    one of its helpers (``loading.vocabulary_merges``), which does without it rather than wait for a build."""
    installed = _installed(installed_dir())
    if installed is not False:
        return installed
    target = library_path()
    return target if target.exists() else None


def _after_any_build(target: Path) -> Path | None:
    if not target.exists():
        with build_lock(target):
            pass
    return target if target.exists() else None


def build_cpu_kernels() -> Path | None:
    """A build for this CPU, compiled now if it is not there yet; None where there is no C compiler or it failed,
    now or before (torch's ops serve then)."""
    target = library_path()
    if target.exists():
        return target
    with build_lock(target):
        return target if target.exists() else _compile(target)


def start_building_cpu_kernels() -> None:
    """In gunicorn's master: where no installed variant serves this source, build the library, if absent, in a
    child process that holds the build's lock from before any worker forks. Returns at once; the child releases
    the lock when it exits. A cache it cannot write leaves the workers to torch's ops."""
    if variants.installed_variants(installed_dir()) is not None:
        return
    target = library_path()
    if target.exists() or _failed(target).exists():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(_lock_path(target), "w")
    except OSError as exc:
        log.warning("the CPU kernels cannot be built into %s (%s): torch ops serve", target.parent, exc)
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the lock belongs to the open file, which the child inherits
        if not target.exists():
            subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL, pass_fds=(lock.fileno(),))


def _lock_path(target: Path) -> Path:
    return target.with_suffix(".lock")


def _failed(target: Path) -> Path:
    return target.with_suffix(".failed")


def build_lock(target: Path) -> AbstractContextManager[None]:
    """Held by whoever builds ``target`` (see ``file_lock``)."""
    return file_lock(_lock_path(target), "waiting for the CPU kernels' build")


def _compile(target: Path) -> Path | None:
    if _failed(target).exists():
        return None  # logged when it failed
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (CC or cc) and no installed CPU kernels for this source: torch ops serve")
        return None
    failure = variants.compile_library(compiler, NATIVE, target)
    if failure is not None:
        log.warning("building the CPU kernels failed (not retried: %s), torch ops serve:\n%s", _failed(target), failure)
        _failed(target).write_text(failure)
        return None
    log.info("built the CPU kernels: %s", target)
    return target


if __name__ == "__main__":  # the master's child (start_building_cpu_kernels), holding the inherited lock
    gunicorn_format = "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=gunicorn_format, datefmt="%Y-%m-%d %H:%M:%S %z")
    _compile(library_path())
