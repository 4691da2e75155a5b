"""Our model for a checkpoint: its architecture's module, packed weights (on the CPU kernels, or torch's), and
the checkpoint's other weights, read one tensor at a time."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..config import EngineConfig
from ..kernels.build import kernels_library
from ..kernels.cpu import CpuKernels, attach_kernels
from ..kernels.weight_groups import Int8Groups
from ..layers.crossing_points import choose_max_rows
from ..layers.packed_embedding import share_embedding_with_packed_head
from ..layers.quantization import kinds, pack_on_kernels, packed_layers, quantize_with_torch
from ..models import allocate_model, model_class
from ..runtime.cache_files import cache_root
from ..runtime.heap import release_free_heap
from .checkpoint_tensors import CheckpointTensors
from .packed_groups_file import StoredGroups
from .packing import layer_groups, stored_int4

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
    model = allocate_model(hf_config, device, dtype)
    _load_and_quantize(model, method, model_dir, device, dtype, kernels)
    if kernels is not None:
        share_embedding_with_packed_head(model)  # where not known before: the table read is compared
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
    """Packed weights for small steps. On the kernels: every linear layer (``packing``), built from the
    checkpoint before the other weights load, so no full-precision copy of a projection is read into the model
    or kept (a start of the default model reads 190 MB of its converted files, not 620). Without them, torch's
    packed copies beside the weights: asked for, or by default a checkpoint's own 4-bit blocks when serving
    bf16 on a CPU. float32 stays exact; GPUs have their own fast GEMMs."""
    if device.type != "cpu":
        if method != "auto" and method != "none":
            raise ValueError(f"quantization {method!r} is implemented for the CPU only, not {device.type}")
        method = "none"
    stored = StoredGroups(model_dir)
    names = model.checkpoint_names
    if kernels is not None and method != "none":
        values = CheckpointTensors(model_dir, torch.float32)
        pack_on_kernels(model, lambda linear: layer_groups(method, names(linear), stored, values), kernels)
        if _head_known_to_hold_the_table(model, method, stored, values):
            share_embedding_with_packed_head(model, known_exact=True)  # before the table is read
        elif (from_file := values.embedding_in_file("model.embed_tokens.weight")) is not None:
            model.embed_tokens = from_file  # the table is never read: its rows come from the GGUF's blocks
            log.info("embedding rows read from the GGUF's own blocks at each lookup: no table kept")
    _load_weights(model, model_dir, dtype)
    if kernels is None and method == "auto" and not (stored and dtype == torch.bfloat16):
        method = "none"
    if kernels is None and method != "none":
        quantize_with_torch(model, method, lambda linear: stored_int4(names(linear), stored))
    layers = packed_layers(model)
    if layers:
        choose_max_rows(layers, cache_root() / PACKED_ROWS_FILE)
        log.info("quantization %s: %s", method, kinds(layers))
        release_free_heap()  # packing leaves ~100 MB of freed, fragmented heap behind (per-layer transients)
    unpacked = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if layers and unpacked:
        log.warning("%d linear layers stay unpacked (inputs not in groups of 32): %s", len(unpacked), unpacked[:3])


def _head_known_to_hold_the_table(
    model: nn.Module, method: str, stored: StoredGroups, values: CheckpointTensors
) -> bool:
    """Whether the packed LM head is known to hold a tied embedding exactly, without reading the table: the copy keeps
    the table only as int8 groups (a converted GGUF keeps a weight so where they give its values bit for bit, as
    Q8_0 blocks do), which the head packs as they are, so the table would be those groups dequantized, the very
    products the head's rows are (tests hold the two to it). A first load of Gemma 3 270M reads 671 MB less."""
    if not getattr(model, "tied_embeddings", False) or method == "int4":
        return False
    (name,) = model.checkpoint_names("lm_head")
    return stored.format_of(name) is Int8Groups and values.only_as_groups(name)


def _load_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype) -> None:
    """The checkpoint's tensors, read one by one into the model's parameters."""
    for param in model.parameters():
        param.detach().fill_(float("nan"))  # "not loaded", until the checkpoint writes it
    model.load_hf_state_dict(CheckpointTensors(model_dir, dtype))
    unloaded = [name for name, param in model.named_parameters() if param.isnan().any()]
    if unloaded:
        raise ValueError(f"{model_dir}: the checkpoint has no (or NaN) values for {', '.join(unloaded[:5])}")
