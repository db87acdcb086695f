"""Rotary position embedding frequencies for every RoPE variant the configs allow.

The network builds cos/sin tables as ``cos(pos * inv_freq) * scale``; this module
only supplies ``inv_freq`` and ``scale`` so that scaled-context checkpoints (Llama 3.1,
YaRN-extended Qwen2, ...) produce the same angles they were trained with.
"""

from __future__ import annotations

import math

import torch

from multispec.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32) and the cos/sin scale factor.

    ``seq_len`` matters only for ``dynamic`` (NTK) scaling, whose base grows once the
    sequence is longer than ``max_position_embeddings``; callers that cache the table
    must recompute it when the sequence outgrows the length it was built for.
    """
    scaling = config.rope_scaling or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    dim = config.rotary_dim
    if rope_type == "default":
        return _base_inv_freq(config.rope_theta, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(config.rope_theta, dim) / scaling["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic(config, scaling["factor"], seq_len), 1.0
    if rope_type == "llama3":
        return _llama3(config, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling)
    if rope_type == "longrope":
        return _longrope(config, scaling)
    raise ValueError(f"unsupported RoPE type {rope_type!r}")


def _base_inv_freq(base: float, dim: int, factors: torch.Tensor | None = None) -> torch.Tensor:
    """1 / base^(2i / dim), each divided by its factor where given (LongRoPE), in one rounding."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents if factors is None else factors * base**exponents)


def _dynamic(config: ModelConfig, factor: float, seq_len: int | None) -> torch.Tensor:
    """NTK-aware scaling: raise the base so the longest wavelength stretches to ``seq_len``."""
    trained = config.max_position_embeddings
    length = max(seq_len or trained, trained)
    dim = config.rotary_dim
    base = config.rope_theta * (factor * length / trained - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def _llama3(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow (long-wavelength) components are divided by ``factor``, fast ones kept,
    and the band in between interpolated smoothly."""
    inv_freq = _base_inv_freq(config.rope_theta, config.rotary_dim)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]

    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, out)


def _yarn(config: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between, and rescale attention."""
    dim = config.rotary_dim
    base = config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension index whose wavelength fits ``rotations`` times in the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)

    extrapolated = _base_inv_freq(base, dim)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # 1 where the original frequency is kept, 0 where it is interpolated
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def _longrope(config: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own searched factor, and attention rescaled
    by sqrt(1 + ln(factor) / ln(original)). The short factors are the ones for sequences within
    ``original_max_position_embeddings``, which ``ModelConfig.context_window`` keeps sequences to
    wherever the long ones differ (past it the model switches to those for every new token)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    return _base_inv_freq(config.rope_theta, config.rotary_dim, factors), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
