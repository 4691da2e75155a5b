"""Runs one scheduled step on the device: inputs, forward pass, logits.

Owns our model module and the paged KV cache. All torch work of the engine
happens here and in the sampler, on the engine's thread.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from .config import EngineConfig
from .layers.attention import AttentionMetadata, PrefillChunk
from .layers.quantization import quantize_linear_layers
from .model_loader import CheckpointTensors
from .models import MODEL_REGISTRY
from .scheduler import ScheduledSequence
from .sequence import Sequence

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 256 << 20
_CUDA_MEMORY_FRACTION = 0.9


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        max_positions = hf_config.max_position_embeddings
        model_cls = MODEL_REGISTRY[hf_config.model_type]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in the target dtype: no float32 copy of the weights
        try:
            with torch.device(device):
                self.model = model_cls(hf_config, max_positions)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_hf_state_dict(CheckpointTensors(model_dir, dtype))
        if config.quantization:
            quantize_linear_layers(self.model, config.quantization, device)
        self.model.eval()
        self.max_model_len = min(config.max_model_len or max_positions, self.model.max_positions)

        num_layers = hf_config.num_hidden_layers
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        bytes_per_block = 2 * num_layers * self.block_size * num_kv_heads * head_dim * dtype.itemsize
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_budget(config) // bytes_per_block)
        num_slots = self.num_blocks * self.block_size
        self.kv_caches = [
            (
                torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        log.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB, %s %s)",
            self.num_blocks, self.block_size, self.num_blocks * bytes_per_block / 2**20, device, dtype,
        )

    def _kv_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory_bytes:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _CUDA_MEMORY_FRACTION)
        return _DEFAULT_CPU_KV_BYTES

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> tuple[list[Sequence], torch.Tensor]:
        """Run the forward pass; return the sequences that sample and their float32 logits rows."""
        # Decodes (one new token) first, then prefill chunks: see layers.attention.
        decodes = [s for s in batch if s.num_new_tokens == 1]
        prefills = [s for s in batch if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        for item in ordered:
            start = item.seq.num_computed_tokens
            input_ids += item.seq.token_ids[start : start + item.num_new_tokens]
            positions += range(start, start + item.num_new_tokens)
        device = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=torch.cat([self._slots(s.seq.block_table, s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens) for s in ordered]),
            num_decode_tokens=len(decodes),
            decode_blocks=None,
            decode_mask=None,
            prefills=[],
        )
        if decodes:
            context_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
            max_blocks = -(-max(context_lens) // self.block_size)
            # Pad with block 0: its slots are masked out.
            padded = [s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(s.seq.block_table)) for s in decodes]
            meta.decode_blocks = torch.tensor(padded, dtype=torch.long, device=device).flatten()
            lens = torch.tensor(context_lens, device=device).unsqueeze(1)
            padded_len = max_blocks * self.block_size
            meta.decode_mask = (torch.arange(padded_len, device=device) < lens).view(len(decodes), 1, 1, padded_len)
        for item in prefills:
            end = item.seq.num_computed_tokens + item.num_new_tokens
            query_pos = torch.arange(item.seq.num_computed_tokens, end, device=device)
            meta.prefills.append(
                PrefillChunk(
                    num_tokens=item.num_new_tokens,
                    context_slots=self._slots(item.seq.block_table, 0, end),
                    causal_mask=torch.arange(end, device=device) <= query_pos.unsqueeze(1),
                )
            )
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        # Only the last token of a sequence that finished its prompt needs logits.
        last_rows, sampling, row = [], [], 0
        for item in ordered:
            row += item.num_new_tokens
            if item.samples:
                last_rows.append(row - 1)
                sampling.append(item.seq)
        if not sampling:
            return [], hidden.new_empty(0)
        return sampling, self.model.compute_logits(hidden[last_rows]).float()

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size
