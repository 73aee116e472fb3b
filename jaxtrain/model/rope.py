"""RoPE inverse frequencies with Llama 3.1/3.2's `llama3` scaling, on the host in float32 as the reference does."""

from __future__ import annotations

import numpy as np


def inv_freq(cfg) -> np.ndarray | None:
  """(head_dim/2,) float32 for model.rope_scaling (None: plain): high kept, low / factor, blended between."""
  if cfg.rope_scaling == "none":
    return None
  half = cfg.head_dim // 2
  base = np.float32(1.0) / (np.float32(cfg.rope_theta) ** (np.arange(half, dtype=np.float32) * 2 / cfg.head_dim))
  old = np.float32(cfg.rope_original_max_position)
  low, high, factor = (np.float32(v) for v in (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor))
  wavelen = np.float32(2 * np.pi) / base
  scaled = np.where(wavelen > old / low, base / factor, base)
  smooth = (old / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, blended, scaled).astype(np.float32)
