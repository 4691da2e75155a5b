"""Giving freed heap back to the system after a load's transients.

glibc keeps freed memory in its arenas (its mmap threshold rises after a large block is freed, so the next ones of
a few MB come from the heap), where it counts towards the process's resident size. After loading, the freed part of
it is no use to anyone.
"""

from __future__ import annotations

import ctypes


def release_free_heap() -> None:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``); elsewhere, nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way
