"""The small pieces every block shares: parameters with logical axes, RMSNorm, the SwiGLU MLP and rotary embeddings.
B batch, L length, D d_model, F d_ff, N heads, E head width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.core.config import ModelConfig
from jaxtrain.model import activation, ops, rope as rope_scaling
from jaxtrain.model.lora import adapted, add_adapters


def param(rngs: nnx.Rngs, shape, axes, std: float) -> nnx.Param:
  """A float32 parameter drawn from N(0, std^2), with the logical axes the rules table maps to the mesh."""
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=("norm",))
    self.eps = eps

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(x_BxLxD.dtype)


class MLP(nnx.Module):
  """The gated MLP: down(glu(gate(x), up(x))), glu model.mlp_activation's (activation.glu)."""

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
  """(sin, cos) of the rotary angles, (B, L, 1, E/2) float32 with model.rope_scaling, once per forward pass."""
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
