"""Runs one scheduled step on the device: inputs, forward pass, logits.

Owns our model module and the paged KV cache. All torch work of the engine
happens here and in the sampler, on the engine's thread.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .attention_inputs import AttentionInputs
from .config import EngineConfig, default_cpu_kv_bytes
from .kernels.attach import attention_fits
from .kernels.cpu import CpuKernels, load_cpu_kernels
from .layers.attention import AttentionMetadata
from .loading.model_builder import build_model, kernels_serve, why_not_on_kernels
from .runtime.cpu_budget import cpu_budget
from .runtime.cpu_share import CpuShare
from .scheduling.kv_cache_manager import KVGroup, plan_kv_groups
from .scheduling.sequence import Sequence
from .scheduling.step_budget import ScheduledSequence

log = logging.getLogger(__name__)

_CUDA_MEMORY_FRACTION = 0.9

KVCache = list[torch.Tensor]  # per layer: every slot's key heads then value heads (see layers.attention)


@dataclass
class PromptLogits:
    """Logits over prompt positions, for prompt logprobs: row k predicts prompt token ``first + k``."""

    seq: Sequence
    first: int
    logits: torch.Tensor


@dataclass
class PooledRows:
    """Final hidden states (float32) of prompt positions ``first``.., for a sequence that embeds its prompt."""

    seq: Sequence
    first: int
    hidden: torch.Tensor


@dataclass
class DraftLogits:
    """Logits of a sequence's last token and each draft token after it: row k checks draft token k."""

    seq: Sequence
    logits: torch.Tensor


@dataclass
class StepLogits:
    """What a step computed: one row per sampling sequence, prompt positions where asked for, hidden states of
    prompts being embedded, and the rows of sequences that verify a draft."""

    sampling: list[Sequence]
    logits: torch.Tensor
    prompt: list[PromptLogits] = field(default_factory=list)
    pooled: list[PooledRows] = field(default_factory=list)
    drafts: list[DraftLogits] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.cpu_share = _cpu_share() if device.type == "cpu" else None
        # Float32 rows on packed weights; unpacked models stay on torch's ops (float32 exact).
        on_kernels = kernels_serve(config, hf_config, device) and dtype == torch.float32
        if device.type == "cpu" and not on_kernels:
            reason = why_not_on_kernels(config, hf_config) or f"the kernels take float32 rows, not {dtype}"
            log.info("steps run on torch's ops: %s", reason)
        self.kernels = kernels = load_cpu_kernels() if on_kernels else None
        if kernels is not None:
            _use_activations(kernels, config.activations)
        # Half the cache in IEEE halves, as llama.cpp keeps it: 3 bits more than bf16 (8-bit activations' top-1
        # agreement over 4,000 tokens, the shipped model: see docs/models.md)
        self.kv_dtype = torch.float16 if kernels is not None else dtype
        self.model = build_model(hf_config, model_dir, config.quantization, device, dtype, kernels)
        self.max_model_len = min(config.max_model_len or hf_config.max_position_embeddings, self.model.max_positions)
        if config.max_model_len and config.max_model_len > self.max_model_len:  # vLLM refuses it; one setting
            limit = (config.max_model_len, self.max_model_len)  # may cover several models here: each its most
            log.warning("max_model_len %d is past the model's %d positions: clamped to them", *limit)
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.attention_inputs = AttentionInputs(
            config.block_size,
            device,
            dtype,
            getattr(self.model, "sliding_window", 0),  # its sliding-window layers' (masks built per step)
            kernels is not None and attention_fits(self.head_dim),
        )
        self.num_layers = hf_config.num_hidden_layers
        self.kv_groups = plan_kv_groups(
            getattr(self.model, "layer_windows", None) or [0] * self.num_layers,
            self._layer_block_bytes(),
            self._kv_budget(config),
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_kv_blocks,
        )
        self.kv_group_caches: list[torch.Tensor] = []  # each group's layers, as one tensor (``kv_store``)
        self.kv_caches = self._allocate_kv_cache()
        self._fit_max_model_len(config.max_num_batched_tokens)

    # --- construction: size the KV cache, allocate -----------------------------------
    def _layer_block_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory_bytes:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _CUDA_MEMORY_FRACTION)
        return default_cpu_kv_bytes(self._layer_block_bytes() * self.num_layers // self.block_size)

    def _fit_max_model_len(self, chunk: int) -> None:
        """A window larger than the cache would refuse every request that leaves max_tokens to fill it: clamp it,
        as vLLM does, and say how to get more. Each pool bounds it (``_sequence_room``)."""
        capacity = min(self._sequence_room(group, chunk) for group in self.kv_groups)
        if self.max_model_len > capacity:
            log.warning(
                "max_model_len %d is more than the KV cache holds: clamped to %d tokens "
                "(WSGI_INFER_KV_CACHE_MEMORY_MB raises it)",
                self.max_model_len,
                capacity,
            )
            self.max_model_len = int(capacity)

    def _sequence_room(self, group: KVGroup, chunk: int) -> float:
        """The most tokens one sequence can hold in ``group``'s pool: all of it, or without bound where the layers
        slide and the pool holds a window and a chunk (a sequence holds no more, whatever its length). A sliding
        pool smaller than the global one bounds the window too: Gemma 3 270M's in 8 MiB held 448 tokens beside
        the global pool's 480, and a prompt between them waited for a block for ever."""
        held = group.num_blocks * self.block_size
        if group.window and held >= (-(-(group.window + chunk) // self.block_size) + 1) * self.block_size:
            return math.inf
        return held

    def _allocate_kv_cache(self) -> KVCache:
        caches: list[torch.Tensor | None] = [None] * self.num_layers
        for group in self.kv_groups:
            shape = (group.num_blocks * self.block_size, 2 * self.num_kv_heads, self.head_dim)
            layers = _zeros((len(group.layers), *shape), self.kv_dtype, self.device)
            self.kv_group_caches.append(layers)
            for i, layer in enumerate(group.layers):
                caches[layer] = layers[i]
            log.info(
                "KV cache: %d blocks of %d tokens (%d tokens) for %d layers%s (%.0f MiB, %s %s)",
                group.num_blocks,
                self.block_size,
                group.num_blocks * self.block_size,
                len(group.layers),
                f" with a window of {group.window}" if group.window else "",
                group.num_blocks * len(group.layers) * self._layer_block_bytes() / 2**20,
                self.device,
                self.kv_dtype,
            )
        return caches

    # --- one step: prepare inputs, run, select logits ----------------------------------
    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> StepLogits:
        """Run the forward pass; return float32 logits of the rows that are needed."""
        threads = self.cpu_share.threads_for_step() if self.cpu_share is not None else None
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        # In torch, one query token per item (decodes, and prefill chunks cut down to one
        # token) first, then the longer prefill chunks: see layers.attention.
        single_token = [s for s in batch if s.num_new_tokens == 1]
        ordered = single_token + [s for s in batch if s.num_new_tokens > 1]
        input_ids, positions = [], []
        for item in ordered:
            start, end = item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens
            input_ids += item.seq.token_ids[start:end] + item.seq.draft[: item.num_draft_tokens]
            positions += range(start, end)
        meta = self.attention_inputs.build(ordered, len(single_token), 0)
        if len(self.kv_groups) > 1:  # the sliding-window layers' own blocks
            meta.window_group = self.attention_inputs.build(ordered, len(single_token), 1)
        hidden = self._run(input_ids, positions, meta)
        sampling, logits, drafts = self._select_logits(hidden, ordered)
        return StepLogits(sampling, logits, self._prompt_logits(hidden, ordered), self._pooled(hidden, ordered), drafts)

    def _run(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(ids, pos, self.kv_caches, meta)

    def _select_logits(
        self, hidden: torch.Tensor, ordered: list[ScheduledSequence]
    ) -> tuple[list[Sequence], torch.Tensor, list[DraftLogits]]:
        """Only the last token of a sequence that finished its prompt needs logits, and each draft token's row
        after it; one LM head call for all."""
        last_rows, sampling, draft_rows, verifying, row = [], [], [], [], 0
        for item in ordered:
            row += item.num_new_tokens
            if item.samples and item.num_draft_tokens:
                draft_rows.append(range(row - 1 - item.num_draft_tokens, row))
                verifying.append(item.seq)
            elif item.samples:
                last_rows.append(row - 1)
                sampling.append(item.seq)
        if not sampling and not verifying:
            return [], hidden.new_empty(0), []
        logits = self.model.compute_logits(hidden[last_rows + [r for rows in draft_rows for r in rows]]).float()
        drafts, at = [], len(last_rows)
        for seq, rows in zip(verifying, draft_rows):
            drafts.append(DraftLogits(seq, logits[at : at + len(rows)]))
            at += len(rows)
        return sampling, logits[: len(last_rows)], drafts

    def _prompt_logits(self, hidden: torch.Tensor, ordered: list[ScheduledSequence]) -> list[PromptLogits]:
        """Rows of the prompt positions whose next-token logprobs are still to be collected."""
        found, row = [], 0
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:
                # Position p predicts token p + 1; tokens 1..len(collected) are done (recomputes skip them).
                lo = max(start, len(seq.prompt_logprobs))
                hi = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
                if lo < hi:
                    rows = hidden[row + lo - start : row + hi - start]
                    found.append(PromptLogits(seq, lo + 1, self.model.compute_logits(rows).float()))
            row += item.num_new_tokens
        return found

    @staticmethod
    def _pooled(hidden: torch.Tensor, ordered: list[ScheduledSequence]) -> list[PooledRows]:
        """Rows of the prompt positions not yet pooled (a recompute after preemption skips those that were)."""
        found, row = [], 0
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            lo, hi = max(start, seq.num_pooled), min(start + item.num_new_tokens, seq.num_prompt_tokens)
            if seq.params.pooling is not None and lo < hi:
                found.append(PooledRows(seq, lo, hidden[row + lo - start : row + hi - start].float()))
            row += item.num_new_tokens
        return found


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in an anonymous mapping, whose pages the system gives, zeroed, on a first write (torch.zeros
    writes every byte: the default 256 MiB KV cache cost 70 ms of each load, all of it resident before any sequence
    used it). The tensor holds the mapping; it is unmapped with the last view."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)


_SHARE: list[CpuShare] = []  # the process's: the models a thread steps share its crowding


def _cpu_share() -> CpuShare:
    """Threads for the CPU's steps: torch's (the server sets them per worker), within the CPUs this process may
    use (``cpu_budget``), fewer while other work crowds them (``cpu_share``). The models a server's engine thread
    steps share one: the crowding is the thread's, not a model's. Settings of torch's threads by others (a
    test's) start a new one."""
    share = _SHARE[0] if _SHARE else None
    if share is not None and torch.get_num_threads() in (share.stepping, share.threads, share.most):
        return share
    budget = cpu_budget()
    threads = min(torch.get_num_threads(), budget.threads)
    torch.set_num_threads(threads)
    log.info("CPU steps use up to %d threads (%s)", threads, budget.reason)
    _SHARE[:] = [CpuShare(threads)]
    return _SHARE[0]


def _use_activations(kernels: CpuKernels, activations: str) -> None:
    """The setting, said once: 8-bit activations change outputs, so a server says when it trades exactness for
    speed."""
    kernels.use_exact_activations(activations == "int16")
    if activations == "int8":
        log.info(
            "8-bit activations: packed multiplies take each row's blocks of 32 inputs (256 before K-quants) as 8-bit "
            "integers, as llama.cpp does (each input within 1/254 of its block's largest: not exact; activations=int16 "
            "is)"
        )
