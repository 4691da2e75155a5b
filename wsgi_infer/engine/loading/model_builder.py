"""Our model for a checkpoint: its architecture's module, packed weights (on the CPU kernels, or torch's), and
the checkpoint's other weights, read one tensor at a time."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from ..config import EngineConfig
from ..kernels.attach import attach_kernels
from ..kernels.build import kernels_library
from ..kernels.cpu import CpuKernels
from ..kernels.packed import PackedWeight, bits_per_weight
from ..layers.crossing_points import choose_max_rows
from ..layers.packed_embedding import share_embedding_with_packed_head
from ..layers.quantization import PackedLinear, kinds, pack_on_kernels, packed_layers, quantize_with_torch
from ..models import allocate_model, model_class
from ..runtime.cache_files import cache_root
from ..runtime.heap import release_free_heap
from ..runtime.huge_pages import HugePageArena
from .checkpoint_tensors import CheckpointTensors, require_weights
from .packing import layer_weight

log = logging.getLogger(__name__)

PACKED_ROWS_FILE = "packed-max-rows.json"  # in the cache root: the crossing points measured on this machine


def kernels_serve(config: EngineConfig, hf_config, device: torch.device) -> bool:
    """Whether a CPU engine's every linear layer would be packed on the CPU kernels (and its step run there, in
    float32 rows): the kernels are built, the architecture runs on them, and packing is not turned off."""
    return device.type == "cpu" and why_not_on_kernels(config, hf_config) is None


def why_not_on_kernels(config: EngineConfig, hf_config) -> str | None:
    """Why a CPU engine's steps would stay on torch's ops (None: they would not), for the log."""
    if config.quantization == "none":
        return "quantization none was asked for (float32 there is exactly transformers' arithmetic)"
    if not getattr(model_class(hf_config.model_type), "runs_on_kernels", False):
        return f"{hf_config.model_type} has no path on the CPU kernels"
    if kernels_library() is None:
        return "no CPU kernels for this CPU (none installed for it, and none could be built: see the log)"
    return None


def build_model(
    hf_config, model_dir: Path, method: str, device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None
) -> nn.Module:
    """Our module for the checkpoint in ``model_dir``, weights packed by ``method`` and loaded, in eval mode."""
    require_weights(model_dir)
    model = allocate_model(hf_config, device, dtype)
    _load_and_quantize(model, method, model_dir, device, dtype, kernels)
    if kernels is not None:
        attach_kernels(model, kernels)
    return model.eval()


def _load_and_quantize(
    model: nn.Module,
    method: str,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    kernels: CpuKernels | None,
) -> None:
    """Packed weights. On the kernels: every linear layer (``packing``), a GGUF's from its own blocks, built before
    the other weights load, so no full-precision copy of a projection is read into the model or kept. Without them
    (no compiler for them here), torch's packed copies beside the weights where asked for, for small steps; by
    default none: float32 stays exact. GPUs have their own fast GEMMs."""
    if device.type != "cpu":
        if method != "auto" and method != "none":
            raise ValueError(f"quantization {method!r} is implemented for the CPU only, not {device.type}")
        method = "none"
    if kernels is not None and method != "none":
        _pack_on_kernels(model, method, model_dir, kernels)
    _load_weights(model, model_dir, dtype)
    if kernels is None and method == "auto":
        method = "none"
    if kernels is None and method != "none":
        quantize_with_torch(model, method)
        choose_max_rows(packed_layers(model), cache_root() / PACKED_ROWS_FILE)
    if kernels is not None or method != "none":
        log.info("quantization %s: %s", method, kinds(model))
        release_free_heap()  # packing leaves freed, fragmented heap behind (per-layer transients)
    unpacked = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if method != "none" and unpacked:
        log.warning("%d linear layers stay unpacked (inputs not in groups of 32): %s", len(unpacked), unpacked[:3])


def _pack_on_kernels(model: nn.Module, method: str, model_dir: Path, kernels: CpuKernels) -> None:
    """Every linear layer packed, the LM head's rows serving a tied embedding where they are the file's, else the
    embedding's rows read from the GGUF at each lookup where it is there: the table is never read. The log gives
    the tiles' rate: far below the memory's (0.4-1 GB/s against tens) is a host faulting the memory in
    (docs/benchmarks/start-up.md)."""
    started = time.monotonic()
    values = CheckpointTensors(model_dir, torch.float32)
    names, memory = model.checkpoint_names, HugePageArena()

    def weight_of(linear: str) -> PackedWeight | None:
        return layer_weight(method, names(linear), values.blocks, values, memory, kernels)

    pack_on_kernels(model, weight_of, kernels)
    if not share_embedding_with_packed_head(model):
        from_file = values.embedding_in_file("model.embed_tokens.weight")
        if from_file is not None:
            model.embed_tokens = from_file
            log.info("embedding rows read from the GGUF's own blocks at each lookup: no table kept")
    packed = [m.packed for m in model.modules() if isinstance(m, PackedLinear)]
    held, seconds = sum(weight.nbytes for weight in packed), time.monotonic() - started
    log.info(
        "packed weights: %d MiB laid out in %.2f s (%.2f GB/s); bits a weight by format: %s",
        held >> 20,
        seconds,
        held / seconds / 1e9,
        bits_per_weight(packed),
    )


def _load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype) -> None:
    """The checkpoint's tensors, read one by one into the model's parameters."""
    for param in model.parameters():
        param.detach().fill_(float("nan"))  # "not loaded", until the checkpoint writes it
    model.load_hf_state_dict(CheckpointTensors(model_dir, dtype))
    unloaded = [name for name, param in model.named_parameters() if param.isnan().any()]
    if unloaded:
        raise ValueError(f"{model_dir}: the checkpoint has no (or NaN) values for {', '.join(unloaded[:5])}")
