"""The gated MLP's activation, shared by the dense MLP and every expert kernel (model.mlp_activation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.core.config import ModelConfig


def of(cfg: ModelConfig) -> tuple[float, float] | None:
  """The static activation argument of `glu`: None for SwiGLU, (alpha, limit) for the clamped form."""
  return (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.mlp_activation == "swiglu_clamped" else None


def glu(g, u, act: tuple[float, float] | None = None):
  """silu(g) * u; with act = (alpha, limit) GPT-OSS's clamped form: the clamps keep its large activations finite in
  low precision, and (u + 1) lets a zero up projection pass the gate through."""
  if act is None:
    return jax.nn.silu(g) * u
  alpha, limit = act
  g = jnp.minimum(g, limit)
  u = jnp.clip(u, -limit, limit)
  return g * jax.nn.sigmoid(alpha * g) * (u + 1)
