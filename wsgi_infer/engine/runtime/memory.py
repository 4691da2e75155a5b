"""Giving a freed model's memory back to the system, so that an unload shows in the worker's RSS."""

from __future__ import annotations

import ctypes
import gc

# The process's own symbols (libc's among them): ctypes.util.find_library would run ldconfig in a subprocess.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def give_back_freed_memory(on_cuda: bool) -> None:
    """Collect the model's reference cycles, return glibc's free heap pages to the system (a model's many
    medium-sized tensors live in the heap, which glibc keeps for reuse) and empty torch's CUDA cache."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
    if on_cuda:
        import torch

        torch.cuda.empty_cache()
