"""A step that stops part way: the engine thread's stop flag, which the layers read between layers (the CPU
kernels' fused decoder through its address), so that a stop need not wait out a slow step. Imports no torch."""

from __future__ import annotations

import ctypes


class StepInterrupted(Exception):
    """The step stopped between two layers: its results are not there, and the engine is to stop."""


class StepInterrupt:
    def __init__(self) -> None:
        self._flag = ctypes.c_int(0)

    @property
    def address(self) -> int:
        """Where the flag lives, for C code that polls it (a single int: written whole, read whole)."""
        return ctypes.addressof(self._flag)

    def request(self) -> None:
        """From any thread: the step in progress stops at its next layer, and every later one at once."""
        self._flag.value = 1

    def check(self) -> None:
        if self._flag.value:
            raise StepInterrupted
