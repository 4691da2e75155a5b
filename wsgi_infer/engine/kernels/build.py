"""Compiling the CPU kernels for this machine, once, into the user cache.

Imports no torch: the gunicorn master starts the build in a child process
before it forks workers (``on_starting``), because a gevent worker cannot wait
for a child process from its engine thread; the child holds the build's lock,
and workers wait on that lock (``built_library``) while the compiler runs
beside their imports. Offline use (``LLM``) builds them itself.
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
from pathlib import Path

from ..cache_files import cache_root, file_lock
from ..cpu_info import cpu_flags, cpu_model_name

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -march=native: the library is built on, and keyed by, the CPU that runs it. No contraction of a * b + c
# into one rounding, so the kernels round as the torch ops they replace; no errno or traps, which would
# keep loops with exp and selects from vectorizing (neither changes a result).
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
KERNELS_DIR = "kernels"  # in the cache root


def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the library for this source, these flags and this CPU (its model and instruction sets) lives."""
    cpu = f"{cpu_model_name()} {' '.join(sorted(cpu_flags()))}"
    flags = " ".join(FLAGS + extra_flags)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), flags.encode(), cpu.encode()]))
    return cache_root() / KERNELS_DIR / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build_cpu_kernels(extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The compiled library, built now if it is not there yet; None where there is no C compiler
    or it fails (torch's ops serve then). ``extra_flags``: e.g. to build without an instruction set."""
    target = library_path(extra_flags)
    if target.exists():
        return target
    with build_lock(target):
        return target if target.exists() else _compile(target, extra_flags)


def start_building_cpu_kernels() -> None:
    """In gunicorn's master: build the library, if absent, in a child process that holds the build's
    lock from before any worker forks. Returns at once; the child releases the lock when it exits."""
    target = library_path()
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(target), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the lock belongs to the open file, which the child inherits
        if not target.exists():
            subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL, pass_fds=(lock.fileno(),))


def built_library() -> Path:
    """The library's path, once no process is building it (where none could, it stays absent)."""
    target = library_path()
    if not target.exists():
        with build_lock(target):
            pass
    return target


def _lock_path(target: Path) -> Path:
    return target.with_suffix(".lock")


def build_lock(target: Path) -> AbstractContextManager[None]:
    """Held by whoever builds ``target`` (see ``file_lock``)."""
    return file_lock(_lock_path(target), "waiting for the CPU kernels' build")


def _compile(target: Path, extra_flags: tuple[str, ...]) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (CC or cc): the CPU kernels are not built, torch ops serve instead")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(
        [compiler, *FLAGS, *extra_flags, "-o", str(staging), str(SOURCE), "-lm"], capture_output=True, text=True
    )
    if done.returncode != 0:
        log.warning("building the CPU kernels failed, torch ops serve instead:\n%s", done.stderr[-2000:])
        staging.unlink(missing_ok=True)
        return None
    os.replace(staging, target)
    log.info("built the CPU kernels: %s", target)
    return target


if __name__ == "__main__":  # the master's child (start_building_cpu_kernels), holding the inherited lock
    gunicorn_format = "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=gunicorn_format, datefmt="%Y-%m-%d %H:%M:%S %z")
    _compile(library_path(), ())
