"""Device and dtype selection: CUDA with bf16 when present, else the CPU."""

from __future__ import annotations

import torch

from ..config import DTYPES, SettingError

_DTYPES = dict(zip(DTYPES, [torch.float32] * 2 + [torch.bfloat16] * 2 + [torch.float16] * 2, strict=True))


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise SettingError(f"device: unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(f"device: {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device, on_kernels: bool = False) -> torch.dtype:
    """``auto``: bf16 on CUDA. On a CPU, float32 where the CPU kernels serve every layer (``on_kernels``: packed
    weights, float32 activations), and where they do not but the CPU lacks native bf16 (bf16 through torch there
    is emulated, slower than float32); bf16 through torch on a CPU that computes it natively (AVX512-BF16, AMX)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() and not on_kernels else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise SettingError(f"dtype: unknown dtype {dtype!r} (use auto, {', '.join(_DTYPES)})") from None
