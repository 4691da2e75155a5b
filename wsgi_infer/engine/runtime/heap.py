"""Giving freed memory back to the system: after a load's transients, and after a model's unload.

glibc keeps freed memory in its arenas (its mmap threshold rises after a large block is freed, so the next ones of
a few MB come from the heap), where it counts towards the process's resident size. After loading, the freed part of
it is no use to anyone; after an unload, it is the model's weights and KV cache.
"""

from __future__ import annotations

import ctypes
import gc


def release_free_heap() -> None:
    """Return the heap's free memory to the system (glibc's ``malloc_trim``); elsewhere, nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way


def give_back_freed_memory(on_cuda: bool) -> None:
    """After a model is dropped: collect its reference cycles, return the freed heap and empty torch's CUDA
    cache."""
    gc.collect()
    release_free_heap()
    if on_cuda:
        import torch

        torch.cuda.empty_cache()
