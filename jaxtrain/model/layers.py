"""The small pieces every block shares: parameters with logical axes, RMSNorm, the SwiGLU MLP and rotary embeddings.
B batch, L length, D d_model, F d_ff, N heads, E head width."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import activation, ops, rope as rope_scaling
from jaxtrain.model.lora import adapted, add_adapters


def param(rngs: nnx.Rngs, shape, axes, std: float) -> nnx.Param:
  """A float32 parameter drawn from N(0, std^2), with the logical axes the rules table maps to the mesh."""
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):
  """`one_plus` (Gemma): the weight is stored as an offset from 1, (1 + w), zero at init."""

  def __init__(self, dim: int, eps: float, one_plus: bool = False):
    self.scale = nnx.Param((jnp.zeros if one_plus else jnp.ones)((dim,), jnp.float32), axes=("norm",))
    self.eps, self.one_plus = eps, one_plus

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * (1.0 + self.scale[...] if self.one_plus else self.scale[...])).astype(x_BxLxD.dtype)


def norm(cfg: ModelConfig, dim: int | None = None, eps: float | None = None) -> RMSNorm:
  """An RMSNorm of the model (model.norm_convention), over d_model unless `dim`."""
  return RMSNorm(dim or cfg.d_model, cfg.norm_eps if eps is None else eps, cfg.norm_convention == "one_plus")




class MLP(nnx.Module):
  """The gated MLP: down(glu(gate(x), up(x))), glu model.mlp_activation's (activation.glu): SwiGLU, GPT-OSS's
  clamped form, or Gemma's GeGLU."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
    D, F, std = cfg.d_model, d_ff or cfg.d_ff, cfg.init_std
    self.w_gate = param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_up = param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_down = param(rngs, (F, D), ("mlp", "embed"), std)
    add_adapters(self, cfg, rngs, {"w_gate": 1, "w_up": 1, "w_down": 1})
    self.act = activation.of(cfg)

  def __call__(self, x_BxLxD):
    dt = x_BxLxD.dtype
    g_BxLxF = adapted(self, "w_gate", x_BxLxD, ops.matmul(x_BxLxD, ops.weight(self.w_gate, dt)))
    u_BxLxF = adapted(self, "w_up", x_BxLxD, ops.matmul(x_BxLxD, ops.weight(self.w_up, dt)))
    h_BxLxF = ops.constrain(activation.glu(g_BxLxF, u_BxLxF, self.act), ("batch", "length", "act_mlp"))
    h_BxLxF = checkpoint_name(h_BxLxF, "mlp_hidden")
    return adapted(self, "w_down", h_BxLxF, ops.matmul(h_BxLxF, ops.weight(self.w_down, dt)))


def rope_tables(pos_BxL, cfg: ModelConfig):
  """(sin, cos) of the rotary angles, (B, L, 1, E/2) float32 with model.rope_scaling, once per forward pass; with
  model.rope_local_theta, (sin, cos, local sin, local cos): `layer_tables` picks a layer's pair."""
  tables = _angles(pos_BxL, cfg)
  if cfg.rope_local_theta and cfg.sliding_window:
    tables += _angles(pos_BxL, dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling="none"))
  return tables


def layer_tables(tables, window):
  """The (sin, cos) a layer rotates with: the local pair for a local layer (`window` > 0; traced in a scanned
  stack of mixed layers) where `rope_tables` made one."""
  if len(tables) == 2:
    return tables
  if isinstance(window, int):
    return tables[2:] if window else tables[:2]
  return tuple(jnp.where(window > 0, local, full) for full, local in zip(tables[:2], tables[2:]))


def _angles(pos_BxL, cfg: ModelConfig):
  half = rope_scaling.dim(cfg) // 2
  freq_E2 = rope_scaling.inv_freq(cfg)
  freq_E2 = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half) if freq_E2 is None else jnp.asarray(freq_E2)
  ang_BxLx1xE2 = (pos_BxL.astype(jnp.float32)[:, :, None] * freq_E2)[:, :, None, :]
  mag = rope_scaling.table_scale(cfg)  # YaRN scales cos and sin
  return (jnp.sin(ang_BxLx1xE2), jnp.cos(ang_BxLx1xE2)) if mag == 1.0 else (
      jnp.sin(ang_BxLx1xE2) * mag, jnp.cos(ang_BxLx1xE2) * mag)


def rope(x_BxLxNxE, tables):
  """Rotary embedding on pairs (first half, second half) of the head dimension."""
  sin_BxLx1xE2, cos_BxLx1xE2 = tables
  half = x_BxLxNxE.shape[-1] // 2
  x = x_BxLxNxE.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos_BxLx1xE2 - x2 * sin_BxLx1xE2, x2 * cos_BxLx1xE2 + x1 * sin_BxLx1xE2], axis=-1)
  return out.astype(x_BxLxNxE.dtype)
