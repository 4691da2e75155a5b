"""Memory for data that is streamed whole again and again (the packed weights a decode step reads), in 2 MB pages.

Reading a weight from 4 KB pages costs a TLB miss every 4 KB; Linux backs a region with transparent huge pages
where it is asked to (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on these machines). A decode
step of a 1B model's weights read 25.7 GB/s from 4 KB pages and 28.0 from 2 MB ones (AMD EPYC Zen 4, 2 cores). The
region starts on a 2 MB boundary, so that all of a large weight lies in huge pages; it is unmapped when the last
tensor viewing it goes. A model's weights share regions (``HugePageArena``): a region each rounded every weight up
to whole 2 MB pages, and the shipped 135M model's 210 packed parts (120 MB) held 0.5 GB.

Straight into huge pages, though on a virtual machine whose host takes back the free memory its guest reports, each
is faulted in by the host (the 3B shape's 1.9 GB: 4.7 s of a 7.5 s start, against 1.7 s in 4 KB pages). Laid out in
4 KB pages and collapsed once serving, the copies cost as much later and stalled streams 0.2-0.8 s
(docs/benchmarks/start-up.md, 2026-12-04). 64 KB folios (multi-size THP, where an administrator enables them)
fault faster still than 4 KB pages and decode as slowly (0.92x, 2026-12-05).
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of ``nbytes``, on its own anonymous mapping advised to huge pages where the kernel offers
    them (elsewhere, plain pages: the same memory, read a little slower)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: shared memory gets no huge pages
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


class HugePageArena:
    """Tensors carved one after another out of shared huge-page regions of ``region_bytes`` (a larger tensor gets a
    region of its own), each on a 64-byte line. A region lives while any tensor from it does: one arena a model."""

    def __init__(self, region_bytes: int = 32 * HUGE_PAGE) -> None:
        self.region_bytes = region_bytes
        self._region: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        lines = -(-nbytes // 64) * 64
        if self._region is None or self._used + lines > len(self._region):
            # the rest of the last region is never written, so never backed by memory
            self._region, self._used = huge_page_bytes(max(self.region_bytes, lines)), 0
        taken = self._region[self._used : self._used + nbytes]
        self._used += lines
        return taken
