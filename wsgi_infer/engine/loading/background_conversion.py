"""A GGUF's first conversion, begun by gunicorn's master in a child process while the workers import.

A worker imports torch, transformers and the app (about 2 s), then its engine thread loads the model: on a first
start that means converting the GGUF first (the default model 1.5 s, Gemma 3 270M 5 s), one after the other. They
need not be: the master takes the conversion's lock before it forks any worker and hands it to a child, which
converts on the other core while the workers import; their engine threads then wait on that lock, as a server's
second worker waits for its first, and read the converted copy. A child that fails releases the lock by exiting,
and the workers convert, or fail, as they would have alone. The kernels' build (``kernels.build``) is started the
same way. Imports no torch: the master runs it.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

from .model_paths import (
    ModelLoadError,
    conversion_lock_path,
    converted_gguf_dir,
    file_digest,
    is_converted,
    is_gguf,
    model_path,
)

log = logging.getLogger(__name__)


def start_converting(model: str | None) -> None:
    """In gunicorn's master: where ``model`` is a GGUF without its converted copy, convert it in a child that holds
    the conversion's lock from before any worker forks. Returns at once. Hashing a new file here (0.09 s for the
    default model's 100 MB) is work its workers no longer do; where the lock is held already (another server on the
    same cache converts it), or the cache cannot be written, the workers see to it as before."""
    try:
        path = model_path(model)
        if not is_gguf(path):
            return
        target = converted_gguf_dir(path, file_digest(path))
        if is_converted(target):
            return
        lock_path = conversion_lock_path(target)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "w")
    except (ModelLoadError, OSError) as exc:
        log.debug("no conversion ahead of the workers: %s", exc)  # their own load says what is wrong
        return
    with lock:
        try:
            # held by the open file, which the child inherits
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        argv = [sys.executable, "-m", __name__, str(path), str(target), str(lock.fileno())]
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(lock.fileno(),))


def _convert(gguf: Path, target: Path) -> None:
    """In the child, holding the inherited lock."""
    gc.disable()  # while importing, as a worker does: its many objects would be traversed again and again
    import torch

    from .model_loader import convert_unless_done

    gc.enable()
    torch.set_num_threads(1)  # the workers import on the other cores
    convert_unless_done(gguf, target)


if __name__ == "__main__":
    gunicorn_format = "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=gunicorn_format, datefmt="%Y-%m-%d %H:%M:%S %z")
    try:
        _convert(Path(sys.argv[1]), Path(sys.argv[2]))
    except ModelLoadError as exc:
        log.warning("converting ahead of the workers failed; they try again: %s", exc)
    # The waiting workers go on as soon as the lock is released; the interpreter's teardown (about a second of
    # freeing what torch and transformers made) would hold it, and take a core from their loading.
    os.close(int(sys.argv[3]))
    logging.shutdown()
    os._exit(0)
