"""Runs one scheduled step on the device: inputs, forward pass, logits.

Owns our model module and the paged KV cache. All torch work of the engine
happens here and in the sampler, on the engine's thread.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .cache_files import cache_root
from .config import EngineConfig
from .gguf_checkpoint import PACKED_GROUPS_FILE, StoredGroups
from .kernels.build import built_library
from .kernels.cpu import CacheRows, CpuKernels, attach_kernels, attention_fits, load_cpu_kernels
from .layers.attention import AttentionMetadata, PrefillChunk
from .layers.crossing_points import choose_max_rows
from .layers.quantization import kinds, pack_on_kernels, packed_layers, quantize_with_torch
from .model_loader import CheckpointTensors
from .models import MODEL_REGISTRY
from .packing import layer_groups, stored_int4
from .scheduler import ScheduledSequence
from .sequence import Sequence

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 256 << 20
PACKED_ROWS_FILE = "packed-max-rows.json"  # in the cache root: the crossing points measured on this machine
_CUDA_MEMORY_FRACTION = 0.9

KVCache = list[torch.Tensor]  # per layer: every slot's key heads then value heads (see layers.attention)


class _SkipParameterInit(TorchFunctionMode):
    """Leaves new parameters as allocated: the checkpoint fills every one (see ``_load_weights``).

    Random initialisation would cost 1.2 s for the default model, and building on the meta device
    instead imports dynamo (1 s, 60 MB), which runs the meta device's init functions.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@dataclass
class PromptLogits:
    """Logits over prompt positions, for prompt logprobs: row k predicts prompt token ``first + k``."""

    seq: Sequence
    first: int
    logits: torch.Tensor


@dataclass
class StepLogits:
    """What a step computed: one row per sampling sequence, and prompt positions where asked for."""

    sampling: list[Sequence]
    logits: torch.Tensor
    prompt: list[PromptLogits] = field(default_factory=list)


def kernels_serve(config: EngineConfig, hf_config, device: torch.device) -> bool:
    """Whether a CPU engine's every linear layer would be packed on the CPU kernels (and its step run there, in
    float32 rows): the kernels are built, the architecture runs on them, and packing is not turned off."""
    on_kernels = getattr(MODEL_REGISTRY[hf_config.model_type], "runs_on_kernels", False)
    return device.type == "cpu" and config.quantization != "none" and on_kernels and built_library().exists()


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        # Float32 rows on packed weights; unpacked models stay on torch's ops (float32 exact).
        on_kernels = kernels_serve(config, hf_config, device) and dtype == torch.float32
        self.kernels = kernels = load_cpu_kernels() if on_kernels else None
        self.kv_dtype = torch.bfloat16 if kernels is not None else dtype  # half the cache, 0.0-0.1% of agreement
        self.model = self._build_model(hf_config)
        self._load_and_quantize(config.quantization, model_dir, kernels)
        if kernels is not None:
            attach_kernels(self.model, kernels)
        self.model.eval()
        self.max_model_len = min(config.max_model_len or hf_config.max_position_embeddings, self.model.max_positions)
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.attends_on_kernels = kernels is not None and attention_fits(self.head_dim)
        self.num_layers = hf_config.num_hidden_layers
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_budget(config) // self._bytes_per_block())
        self.kv_caches = self._allocate_kv_cache()

    # --- construction: build, load and quantize, size the KV cache, allocate -------
    def _build_model(self, hf_config) -> nn.Module:
        """Our module for the architecture, in the target dtype, its parameters allocated but not written."""
        model_cls = MODEL_REGISTRY[hf_config.model_type]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # build in the target dtype: no float32 copy of the weights
        try:
            with torch.device(self.device), _SkipParameterInit():
                return model_cls(hf_config, hf_config.max_position_embeddings)
        finally:
            torch.set_default_dtype(default_dtype)

    def _load_and_quantize(self, method: str, model_dir: Path, kernels: CpuKernels | None) -> None:
        """Packed weights for small steps. On the kernels: every linear layer (``packing``), built from the
        checkpoint before the other weights load, so no full-precision copy of a projection is read into the model
        or kept (a start of the default model reads 190 MB of its converted files, not 620). Without them, torch's
        packed copies beside the weights: asked for, or by default a checkpoint's own 4-bit blocks when serving
        bf16 on a CPU. float32 stays exact; GPUs have their own fast GEMMs."""
        if self.device.type != "cpu":
            if method != "auto" and method != "none":
                raise ValueError(f"quantization {method!r} is implemented for the CPU only, not {self.device.type}")
            method = "none"
        stored = StoredGroups(model_dir / PACKED_GROUPS_FILE)
        names = self.model.checkpoint_names
        if kernels is not None and method != "none":
            values = CheckpointTensors(model_dir, torch.float32)
            pack_on_kernels(self.model, lambda linear: layer_groups(method, names(linear), stored, values), kernels)
        self._load_weights(model_dir)
        if kernels is None and method == "auto" and not (stored and self.dtype == torch.bfloat16):
            method = "none"
        if kernels is None and method != "none":
            quantize_with_torch(self.model, method, lambda linear: stored_int4(names(linear), stored))
        layers = packed_layers(self.model)
        if layers:
            choose_max_rows(layers, cache_root() / PACKED_ROWS_FILE)
            log.info("quantization %s: %s", method, kinds(layers))
            _release_free_heap()
        unpacked = [name for name, m in self.model.named_modules() if isinstance(m, nn.Linear)]
        if layers and unpacked:
            log.warning("%d linear layers stay unpacked (inputs not in groups of 32): %s", len(unpacked), unpacked[:3])

    def _load_weights(self, model_dir: Path) -> None:
        """The checkpoint's tensors, read one by one into the model's parameters."""
        for param in self.model.parameters():
            param.detach().fill_(float("nan"))  # "not loaded", until the checkpoint writes it
        self.model.load_hf_state_dict(CheckpointTensors(model_dir, self.dtype))
        unloaded = [name for name, param in self.model.named_parameters() if param.isnan().any()]
        if unloaded:
            raise ValueError(f"{model_dir}: the checkpoint has no (or NaN) values for {', '.join(unloaded[:5])}")

    def _bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory_bytes:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _CUDA_MEMORY_FRACTION)
        return _DEFAULT_CPU_KV_BYTES

    def _allocate_kv_cache(self) -> KVCache:
        shape = (self.num_blocks * self.block_size, 2 * self.num_kv_heads, self.head_dim)
        caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]
        log.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, %s %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self._bytes_per_block() / 2**20,
            self.device,
            self.kv_dtype,
        )
        return caches

    # --- one step: prepare inputs, run, select logits ----------------------------------
    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> StepLogits:
        """Run the forward pass; return float32 logits of the rows that are needed."""
        # In torch, one query token per item (decodes, and prefill chunks cut down to one
        # token) first, then the longer prefill chunks: see layers.attention.
        single_token = [s for s in batch if s.num_new_tokens == 1]
        ordered = single_token + [s for s in batch if s.num_new_tokens > 1]
        input_ids, positions, slots = [], [], []
        for item in ordered:
            start, end = item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens
            input_ids += item.seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(item.seq.block_table, start, end)
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=self._longs(slots),
            num_single_token_seqs=len(single_token),
        )
        if self.attends_on_kernels:
            meta.cache_rows = self._cache_rows(ordered)
        else:
            self._prepare_single_token(meta, single_token)
            self._prepare_prefill(meta, ordered[len(single_token) :])
        hidden = self._run(input_ids, positions, meta)
        return StepLogits(*self._select_logits(hidden, ordered), self._prompt_logits(hidden, ordered))

    def _cache_rows(self, items: list[ScheduledSequence]) -> CacheRows:
        """For the kernels: each sequence's blocks, and each token's sequence and how far it sees."""
        padded = self._padded_block_tables(items, [s.seq.num_computed_tokens + s.num_new_tokens for s in items])
        row_seqs, context_lens = [], []
        for index, item in enumerate(items):
            start = item.seq.num_computed_tokens
            row_seqs += [index] * item.num_new_tokens
            context_lens += range(start + 1, start + item.num_new_tokens + 1)
        return CacheRows(self.block_size, *(self._longs(v) for v in (padded, row_seqs, context_lens)))

    def _padded_block_tables(self, items: list[ScheduledSequence], context_lens: list[int]) -> list[list[int]]:
        """Block tables padded with block 0 to the longest context: the padding's slots are never attended."""
        max_blocks = -(-max(context_lens) // self.block_size)
        return [s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(s.seq.block_table)) for s in items]

    def _longs(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prepare_single_token(self, meta: AttentionMetadata, items: list[ScheduledSequence]) -> None:
        """Block tables padded to the longest context, and the mask of each row's real slots."""
        if not items:
            return
        context_lens = [s.seq.num_computed_tokens + 1 for s in items]
        padded = self._padded_block_tables(items, context_lens)
        meta.single_token_blocks = self._longs(padded).flatten()
        padded_len = len(padded[0]) * self.block_size
        real = (torch.arange(padded_len, device=self.device) < self._longs(context_lens).unsqueeze(1)).view(
            len(items), 1, 1, padded_len
        )
        meta.single_token_mask = self._additive(real)

    def _prepare_prefill(self, meta: AttentionMetadata, items: list[ScheduledSequence]) -> None:
        """Per chunk: the slots of its whole context, and a causal mask offset by the cached prefix."""
        for item in items:
            end = item.seq.num_computed_tokens + item.num_new_tokens
            query_pos = torch.arange(item.seq.num_computed_tokens, end, device=self.device)
            meta.prefills.append(
                PrefillChunk(
                    num_tokens=item.num_new_tokens,
                    context_slots=torch.tensor(self._slots(item.seq.block_table, 0, end), device=self.device),
                    causal_mask=self._additive(torch.arange(end, device=self.device) <= query_pos.unsqueeze(1)),
                )
            )

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA would turn it into scores to add (0 or -inf), once per step, not per layer."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def _run(self, input_ids: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(ids, pos, self.kv_caches, meta)

    def _select_logits(
        self, hidden: torch.Tensor, ordered: list[ScheduledSequence]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Only the last token of a sequence that finished its prompt needs logits."""
        last_rows, sampling, row = [], [], 0
        for item in ordered:
            row += item.num_new_tokens
            if item.samples:
                last_rows.append(row - 1)
                sampling.append(item.seq)
        if not sampling:
            return [], hidden.new_empty(0)
        return sampling, self.model.compute_logits(hidden[last_rows]).float()

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

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """The cache slots of positions start..end-1. In Python: a decode step asks for one slot per row,
        where torch's ops cost 25 µs a row and this 1."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]


def _release_free_heap() -> None:
    """Packing leaves ~100 MB of freed, fragmented heap behind (per-layer transients): give it back."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way
