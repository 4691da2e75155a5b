"""The engine of an embedding model: a sentence-transformers encoder (the BERT family), run by transformers.

It keeps ``LLMEngine``'s surface, so the engine thread, the server's queues, backpressure, metrics and drain
serve it unchanged: inputs wait in a queue, and each step encodes as many as ``max_num_batched_tokens`` allows
(padded to the longest), pools them as the model's sentence-transformers configuration says, and finishes each
with its embedding. There is no KV cache: an input is read in one step.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path

import torch

from .config import EngineConfig
from .loading.model_loader import resolve_model_dir
from .outputs import EngineCounters, RequestDelta
from .runtime.device import resolve_device, resolve_dtype
from .runtime.step_interrupt import StepInterrupt
from .sampling_params import InvalidParameter, SamplingParams
from .text_side import TextSide, text_side

log = logging.getLogger(__name__)

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


class SentenceEncoder:
    """The model's modules as sentence-transformers lists them: the encoder, its pooling, maybe a normalization."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModel

        modules = json.loads((model_dir / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if unknown := [k for k in kinds if k not in SUPPORTED_MODULES]:
            raise ValueError(f"sentence-transformers module {unknown[0]} is not supported ({', '.join(kinds)})")
        pooling_dir = next(model_dir / m["path"] for m in modules if m["type"].endswith("Pooling"))
        pooling = json.loads((pooling_dir / "config.json").read_text())
        modes = [mode for mode in POOLING_MODES if pooling.get(f"pooling_mode_{mode}")]
        others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k[13:] not in modes]
        if len(modes) != 1 or others:
            raise ValueError(f"pooling {pooling} is not supported: one of {', '.join(POOLING_MODES)}")
        self.pooling = modes[0]
        self.normalize = "Normalize" in kinds
        self.model = AutoModel.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        settings_file = model_dir / "sentence_bert_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        self.max_seq_length = int(settings.get("max_seq_length") or self.model.config.max_position_embeddings)
        self.dimensions = pooling.get("word_embedding_dimension") or self.model.config.hidden_size

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Float32 embeddings of a padded batch (``mask``: 1 on real tokens)."""
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).float()
        if self.pooling == "cls_token":
            pooled = hidden[:, 0]
        elif self.pooling == "mean_tokens":
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        elif self.pooling == "max_tokens":
            pooled = hidden.masked_fill(weights == 0, float("-inf")).amax(1)
        else:  # lasttoken: right padding, so each row's last real token
            pooled = hidden[torch.arange(len(ids)), mask.sum(1) - 1]
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled


class EmbeddingEngine:
    task = "embed"

    def __init__(self, config: EngineConfig | None = None, text: TextSide | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        dtype = resolve_dtype(config.dtype, self.device, on_kernels=True)  # auto: float32 on a CPU, bf16 on CUDA
        log.info("loading embedding model from %s on %s as %s", self.model_dir, self.device, dtype)
        self.text = text_side(self.model_dir, text, None)
        self.tokenizer = self.text.tokenizer
        self.encoder = SentenceEncoder(self.model_dir, self.device, dtype)
        self.max_model_len = min(self.encoder.max_seq_length, config.max_model_len or self.encoder.max_seq_length)
        self.last_step_num_tokens = 0
        self._waiting: OrderedDict[str, list[int]] = OrderedDict()
        self._interrupt = StepInterrupt()
        kind, dimensions = self.encoder.model.config.model_type, self.encoder.dimensions
        log.info("model ready: %s, %d dimensions, %s pooling", kind, dimensions, self.encoder.pooling)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        vocab = self.encoder.model.config.vocab_size
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidParameter("input", f"an input must be token ids below {vocab}, and not empty")
        if len(prompt) > self.max_model_len:
            raise InvalidParameter("input", f"an input has {len(prompt)} tokens; this model reads {self.max_model_len}")
        self._waiting[request_id] = list(prompt)
        return len(prompt)

    def abort(self, request_id: str) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def abort_all(self) -> None:
        self._waiting.clear()

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def serving(self) -> bool:
        """Requests waiting: what another model's long step would keep waiting."""
        return self.has_unfinished()

    def interrupt(self) -> None:
        self._interrupt.request()

    def write_stored_blocks(self) -> None:
        """An encoder keeps no KV blocks (a generating engine's KV store writes them here)."""

    def close(self, wait: bool = False) -> None:
        """Nothing runs besides the engine thread (a generating engine's KV store does)."""

    def counters(self) -> EngineCounters:
        nothing = dict.fromkeys(("num_free_blocks", "num_cached_blocks", "num_total_blocks"), 0)  # no KV cache
        cumulative = dict.fromkeys(("num_prefix_query_tokens", "num_prefix_hit_tokens", "num_preemptions"), 0)
        return EngineCounters(num_running=0, num_waiting=len(self._waiting), **nothing, **cumulative)

    def step(self) -> list[RequestDelta]:
        """Encode the inputs that fit one step (the first always does), in arrival order."""
        batch: list[tuple[str, list[int]]] = []
        width = 0  # every row is padded to the longest
        for request_id, ids in self._waiting.items():
            if batch and (len(batch) + 1) * max(width, len(ids)) > self.config.max_num_batched_tokens:
                break
            batch.append((request_id, ids))
            width = max(width, len(ids))
        self._interrupt.check()
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (_, tokens) in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        vectors = self.encoder(ids.to(self.device), mask.to(self.device)).cpu()
        self.last_step_num_tokens = int(mask.sum())
        deltas = []
        for (request_id, tokens), vector in zip(batch, vectors):
            del self._waiting[request_id]
            deltas.append(
                RequestDelta(
                    request_id, "", [], finish_reason="stop", num_prompt_tokens=len(tokens), embedding=vector.tolist()
                )
            )
        return deltas
