"""Where the model runs and in which number format: ``device`` and ``dtype`` arguments resolved.

"auto" dtype is bfloat16 where the hardware multiplies it natively (a CPU with AVX512-BF16 or AMX
tiles, a CUDA GPU that supports it) and float32 elsewhere. On such a CPU a bfloat16 matrix product
runs 2-6x as fast as a float32 one (2.3x at 128 rows on AVX512-BF16 alone, more with AMX), and
decoding reads half the bytes of weights and cache. Logits, sampling and verification stay in
float32 whatever the dtype.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a ``device`` argument names, checked to exist here ("auto": CUDA if any)."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r}: not a device name (use 'auto', 'cpu', 'cuda' or 'cuda:N')") from error
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r}: no CUDA GPU is available here; use 'cpu' or 'auto'")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA GPU(s), numbered from 0")
    elif resolved.type != "cpu":
        try:
            torch.empty(1, device=resolved)
        except (RuntimeError, AssertionError) as error:
            raise ValueError(f"device={device!r}: cannot allocate on it here ({error})") from error
    return resolved


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX; read from /proc/cpuinfo,
    so False wherever that is missing)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool(_BF16_FLAGS & set(flags))


KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
"""What the KV cache may store: "auto" (the model's dtype), or bfloat16 keys and values under float32
activations (half the cache's bytes; attention reads them back exactly and computes in float32)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for a ``kv_cache_dtype`` argument under model ``dtype``."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")
    chosen = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
    if chosen != dtype and not (dtype == torch.float32 and chosen == torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: under {name} weights the cache holds {name} ('auto'); "
                         f"only float32 models can keep a bfloat16 cache")
    return chosen


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype a ``dtype`` argument names on ``device``; "auto" picks as the module says.
    A bfloat16 or float16 request where the hardware only emulates it works, with a warning."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if device.type == "cuda":
        native_bf16 = torch.cuda.is_bf16_supported()
    else:
        native_bf16 = cpu_has_fast_bf16()
    if dtype == "auto":
        return torch.bfloat16 if native_bf16 else torch.float32
    if device.type == "cpu" and dtype != "float32" and not (dtype == "bfloat16" and native_bf16):
        warnings.warn(f"dtype={dtype!r}: this CPU has no native {dtype} arithmetic, so it runs emulated and slowly; "
                      f"'float32' (or 'auto') is faster here", stacklevel=3)
    return DTYPES[dtype]
