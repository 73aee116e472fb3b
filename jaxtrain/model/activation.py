"""The gated MLP's activation, shared by the dense MLP and every expert kernel (model.mlp_activation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.core.schema import ModelConfig


def of(cfg: ModelConfig) -> tuple[float, float] | str | None:
  """The static activation argument of `glu`: None for SwiGLU, (alpha, limit) for the clamped form, "gelu_tanh"."""
  if cfg.mlp_activation == "swiglu_clamped":
    return cfg.swiglu_alpha, cfg.swiglu_limit
  return "gelu_tanh" if cfg.mlp_activation == "gelu_tanh" else None


def glu(g, u, act: tuple[float, float] | str | None = None):
  """silu(g) * u; "gelu_tanh": Gemma's GeGLU, gelu(g) (tanh approximation) * u; act = (alpha, limit): GPT-OSS's
  clamped form, whose clamps keep its large activations finite in low precision, and (u + 1) lets a zero up
  projection pass the gate through."""
  if act is None:
    return jax.nn.silu(g) * u
  if act == "gelu_tanh":
    return jax.nn.gelu(g, approximate=True) * u
  alpha, limit = act
  g = jnp.minimum(g, limit)
  u = jnp.clip(u, -limit, limit)
  return g * jax.nn.sigmoid(alpha * g) * (u + 1)
