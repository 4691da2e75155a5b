"""Device and dtype selection: CUDA with bf16 when present, else the CPU."""

from __future__ import annotations

import platform

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _cpuinfo(field: str) -> str | None:
    """The first processor's ``field`` in /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (timings are only comparable on the same one)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_has_vnni() -> bool:
    """True when the CPU multiplies int8 into int32 sums directly (AVX512-VNNI or AVX-VNNI)."""
    flags = (_cpuinfo("flags") or "").split()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {dtype!r} (use auto, {', '.join(_DTYPES)})") from None
