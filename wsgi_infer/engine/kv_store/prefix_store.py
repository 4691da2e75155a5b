"""The engine's side of a KV store: blocks read ahead of a prompt's admission, and written behind its prefill.

On the engine thread, a new prompt whose first block beyond the in-memory prefix cache is in the store (one
``contains``) starts a read of its blocks, in order until one is missing, on the reader thread; admission takes
what was read (it waits for a read that is not over only where no other sequence runs: the read started when the
request arrived) and copies it into the blocks the prefix hit allocates. After a step, each prompt's newly
computed full blocks are noted, and once the step's output is on its way they are copied out of the cache (a
block of a 1B Llama: 0.5 MB, 43 µs) for the writer thread, which frames and stores them: a token never waits for
the store. A store the writer cannot write to (full, read-only, gone) is degraded: one warning, a metric, nothing
written for a while, then one more try; reads go on where they can. Requests never fail for the store. Its
threads are native ones (``runtime.native_threads``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..runtime.native_threads import Empty, SimpleQueue
from .backend import KVStore
from .block_file import CorruptBlock, frame, unframe
from .cache_blocks import CacheBlocks
from .directory import DirectoryStore
from .namespace import store_namespace
from .redis_blocks import RedisStore

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model_runner import ModelRunner
    from ..scheduling.kv_cache_manager import PrefixHit
    from ..scheduling.sequence import Sequence

log = logging.getLogger(__name__)

RETRY_SECONDS = 30.0  # a degraded store is tried again after this
MAX_PENDING_BYTES = 256 << 20  # blocks waiting for the writer; more are dropped, counted
CLOSE_SECONDS = 10.0  # a stopping engine waits this long at most for its writes
NO_BLOCKS: Mapping[bytes, torch.Tensor] = {}


class StoredRead:
    """One prompt's blocks being read: key -> payload, from its first block beyond the in-memory cache."""

    def __init__(self) -> None:
        self.reply: SimpleQueue = SimpleQueue()
        self._blocks: Mapping[bytes, torch.Tensor] | None = None

    def done(self) -> bool:
        return self._blocks is not None or not self.reply.empty()

    def blocks(self) -> Mapping[bytes, torch.Tensor]:
        if self._blocks is None:
            self._blocks = self.reply.get()
        return self._blocks


class PrefixStore:
    """``start_thread`` runs a target on a native thread; ``notify`` (any thread) says the counters moved."""

    def __init__(
        self,
        store: KVStore,
        namespace: bytes,
        blocks: CacheBlocks,
        start_thread: Callable[[Callable[[], None]], None],
        notify: Callable[[], None],
    ) -> None:
        self.store, self.namespace, self.blocks, self._notify = store, namespace, blocks, notify
        self._reads: SimpleQueue = SimpleQueue()
        self._writes: SimpleQueue = SimpleQueue()
        self._closed: SimpleQueue = SimpleQueue()
        self._noted: list[tuple[bytes, list[int], int]] = []  # (key, block id in each pool, its date), to write
        self._chains: list[list[bytes]] = []  # the noted prompts' blocks from the first: marked used once written
        self._queued_bytes = 0  # the engine thread's count
        self._written_bytes = 0  # the writer's: the difference is pending
        self.degraded = False
        self._retry_at = 0.0
        start_thread(self._read_loop)
        start_thread(self._write_loop)

    # --- the engine thread ---------------------------------------------------------------
    def prefetch(self, seq: Sequence, first: int, end: int) -> None:
        """Start reading ``seq``'s blocks ``first``.. (before ``end``) where the store has block ``first``."""
        if first < end and self.store.contains(self.namespace, seq.block_hashes[first]):
            seq.stored_read = read = StoredRead()
            self._reads.put((seq.block_hashes[first:end], read.reply))

    @staticmethod
    def read_done(seq: Sequence) -> bool:
        return not isinstance(seq.stored_read, StoredRead) or seq.stored_read.done()

    @staticmethod
    def blocks_read(seq: Sequence) -> Mapping[bytes, torch.Tensor]:
        read = seq.stored_read
        return read.blocks() if isinstance(read, StoredRead) else NO_BLOCKS

    def load(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """After admission: fill the blocks the hit took from the store; the prompt's blocks before the hit's end
        need no writing."""
        if hit is not None:
            for group, block_id, index in hit.fills:
                self.blocks.write(group, block_id, hit.stored[seq.block_hashes[index]])
            seq.num_stored_blocks = max(seq.num_stored_blocks, hit.num_blocks)
            self._mark_used(seq.block_hashes[: hit.num_blocks])  # a hit in memory is a use of the store's copy too
        seq.stored_read = None

    def note_computed(self, seq: Sequence) -> None:
        """After a step: the prompt's full blocks computed since the last note are to be written (``write_noted``,
        once the step's output is out). Their ids are taken now: a sequence that ended gave its table back."""
        end = min(min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.blocks.block_size, len(seq.block_hashes))
        if not (self.degraded and time.monotonic() < self._retry_at):
            # Dated as used from its first block's noting, each a nanosecond earlier than the one before: a store
            # full while a prompt's blocks are written removes them from its last, as it does once they are marked.
            dated = seq.stored_at_ns = seq.stored_at_ns or time.time_ns()
            for i in range(seq.num_stored_blocks, end):
                self._noted.append((seq.block_hashes[i], [table.blocks[i] for table in seq.block_tables], dated - i))
            if end > seq.num_stored_blocks:
                self._chains.append(seq.block_hashes[:end])
        seq.num_stored_blocks = max(seq.num_stored_blocks, end)

    def write_noted(self) -> None:
        """Copy the noted blocks out of the cache and queue them for the writer. Before the next step allocates:
        until then a block given back (a sequence that ended, a sliding window that moved) keeps its values."""
        for key, block_ids, used_ns in self._noted:
            if self._queued_bytes - self._written_bytes > MAX_PENDING_BYTES:
                self.store.counters.dropped_blocks += 1
                continue
            payload = self.blocks.read(block_ids)
            self._queued_bytes += payload.nbytes
            self._writes.put((key, payload, used_ns))
        self._noted.clear()
        for chain in self._chains:
            self._mark_used(chain)
        self._chains.clear()

    def _mark_used(self, chain: list[bytes]) -> None:
        """Mark a prompt's blocks used, from its last to its first, after the writes queued before: a prompt's first
        block is then its most recently used, and a full store removes its blocks from the last. By write and read
        order the first went first, which left the others unreadable: a hit reads from the first block on."""
        if chain and not (self.degraded and time.monotonic() < self._retry_at):
            self._writes.put((chain[::-1], None, 0))

    def close(self, wait: bool) -> None:
        """End both threads; with ``wait``, after the blocks already noted are written (a server stopping keeps
        them)."""
        if wait:
            self.write_noted()
        self._reads.put(None)
        self._writes.put(None)
        if wait:
            try:
                self._closed.get(timeout=CLOSE_SECONDS)
            except Empty:
                log.warning("KV store: writes still pending after %.0f s were dropped", CLOSE_SECONDS)

    # --- the reader thread -----------------------------------------------------------------
    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            keys, reply = job
            found: dict[bytes, torch.Tensor] = {}
            for key in keys:
                payload = self._read(key)
                if payload is None:
                    break
                found[key] = payload
            reply.put(found)
            if found:
                self._notify()

    def _read(self, key: bytes) -> torch.Tensor | None:
        try:
            data = self.store.get(self.namespace, key)
        except OSError as exc:
            self.store.counters.read_errors += 1
            log.debug("KV store: reading block %s failed: %s", key.hex(), exc)
            return None
        if data is None:
            return None
        try:
            payload = unframe(self.namespace, key, data)
            if payload.nbytes != self.blocks.payload_nbytes:
                raise CorruptBlock(f"{payload.nbytes} bytes, a block here has {self.blocks.payload_nbytes}")
        except CorruptBlock as exc:
            self.store.counters.corrupt_blocks += 1
            log.warning("KV store: block %s removed: %s", key.hex(), exc)
            self.store.discard(self.namespace, key)
            return None
        return self.blocks.payload_of(payload)

    # --- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            key, payload, used_ns = job
            if payload is None:  # a chain to mark used (``_mark_used``)
                if not (self.degraded and time.monotonic() < self._retry_at):
                    self._stored(self.store.mark_used, self.namespace, key)
                continue
            self._write(key, payload, used_ns)
            self._written_bytes += payload.nbytes
            if self._writes.empty():
                self._notify()
        self._closed.put(True)

    def _write(self, key: bytes, payload: torch.Tensor, used_ns: int) -> None:
        if self.degraded and time.monotonic() < self._retry_at:
            return
        framed = frame(self.namespace, key, memoryview(payload.view(torch.uint8).numpy()))
        self._stored(self.store.put, self.namespace, key, framed, used_ns)

    def _stored(self, change: Callable[..., object], *args: object) -> None:
        """Make a change to the store; a failure degrades it (one warning), a success after one ends that."""
        try:
            change(*args)
        except OSError as exc:
            self.store.counters.write_errors += 1
            if not self.degraded:
                log.warning(
                    "KV store %s: %s; nothing is written there for %.0f s (requests are served as before)",
                    self.store.location,
                    exc,
                    RETRY_SECONDS,
                )
            self.degraded, self._retry_at = True, time.monotonic() + RETRY_SECONDS
            return
        if self.degraded:
            log.warning("KV store %s: writable again", self.store.location)
            self.degraded = False


def open_prefix_store(
    config: EngineConfig,
    model_dir: Path,
    runner: ModelRunner,
    start_thread: Callable[[Callable[[], None]], None],
    notify: Callable[[], None],
) -> PrefixStore | None:
    """The engine's store where ``kv_store_dir`` or ``kv_store_url`` is set (and the prefix cache is on: the store
    extends it)."""
    where = config.kv_store_dir or config.kv_store_url
    if not where:
        return None
    if not config.enable_prefix_caching:
        log.warning("the KV store %s is not used: the prefix cache is off", where)
        return None
    if config.kv_store_url:
        store, bound = RedisStore(config.kv_store_url), "bounded by its maxmemory"
    else:
        store, bound = DirectoryStore(Path(where), config.kv_store_mb << 20), f"up to {config.kv_store_mb} MiB"
    blocks = CacheBlocks(runner.kv_group_caches, runner.block_size)
    log.info("KV store %s: %s, %d KiB a block", store.location, bound, blocks.payload_nbytes >> 10)
    return PrefixStore(store, store_namespace(config, model_dir, runner), blocks, start_thread, notify)
