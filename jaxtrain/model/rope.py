"""RoPE inverse frequencies with Llama 3.1/3.2's `llama3` scaling or YaRN (DeepSeek-V3), on the host in float32 as
the references do, and YaRN's two magnitude factors (on cos/sin, and on the softmax scale)."""

from __future__ import annotations

import math

import numpy as np


def dim(cfg) -> int:
  """Width RoPE rotates: the head, or MLA's decoupled RoPE part."""
  return cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim


def inv_freq(cfg) -> np.ndarray | None:
  """(dim/2,) float32 for model.rope_scaling (None: plain)."""
  if cfg.rope_scaling == "none":
    return None
  E = dim(cfg)
  half = E // 2
  pos_E2 = np.float32(cfg.rope_theta) ** (np.arange(half, dtype=np.float32) * 2 / E)
  base = np.float32(1.0) / pos_E2
  if cfg.rope_scaling == "linear":
    return (base / np.float32(cfg.rope_factor)).astype(np.float32)
  if cfg.rope_scaling == "yarn":
    return _yarn(cfg, pos_E2, E)
  # llama3: high kept, low / factor, blended between
  old = np.float32(cfg.rope_original_max_position)
  low, high, factor = (np.float32(v) for v in (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor))
  wavelen = np.float32(2 * np.pi) / base
  scaled = np.where(wavelen > old / low, base / factor, base)
  smooth = (old / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(cfg, pos_E2, E: int) -> np.ndarray:
  """Frequencies turning fewer than beta_slow times over the original context are divided by the factor, more than
  beta_fast kept, a linear ramp over the dimensions between (the correction range floored/ceiled with
  model.rope_truncate, as HF's truncate)."""
  theta, old = cfg.rope_theta, cfg.rope_original_max_position
  at = lambda rot: E * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
  low, high = at(cfg.rope_beta_fast), at(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, E - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(E // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1).astype(np.float32)
  keep = np.float32(1) - ramp  # 1: extrapolate (keep), 0: interpolate (divide by the factor)
  interp_E2 = np.float32(1.0) / (np.float32(cfg.rope_factor) * pos_E2)
  return (interp_E2 * (1 - keep) + np.float32(1.0) / pos_E2 * keep).astype(np.float32)


def _mscale(factor: float, m: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def table_scale(cfg) -> float:
  """YaRN's factor on cos and sin (so on both RoPE'd q and k); 1 otherwise."""
  if cfg.rope_scaling != "yarn":
    return 1.0
  if cfg.rope_mscale and cfg.rope_mscale_all_dim:
    return _mscale(cfg.rope_factor, cfg.rope_mscale) / _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
  return _mscale(cfg.rope_factor)


def softmax_scale(cfg) -> float:
  """YaRN's extra factor on the softmax scale (mscale(factor, mscale_all_dim)^2), 1 without it."""
  if cfg.rope_scaling in ("none", "linear") or not cfg.rope_mscale_all_dim:
    return 1.0
  return _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
