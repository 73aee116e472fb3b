"""Multi-token prediction (DeepSeek-V3), depth 1: at position i the main model's final-normed hidden state h_i and
the embedding of the next token t_{i+1} (both RMS-normed, concatenated, projected back to d_model by eh_proj) go
through one more decoder layer; its output, normed by the module's own head norm, meets the main model's output
head (shared, as the embedding is) to predict t_{i+2}. Training adds model.mtp_weight x its mean cross-entropy."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtrain.model import ops
from jaxtrain.model.block import RESIDUAL, Block
from jaxtrain.model.layers import norm, param


class MTP(nnx.Module):

  def __init__(self, cfg, rngs: nnx.Rngs):
    D = cfg.d_model
    self.enorm, self.hnorm = norm(cfg, D), norm(cfg, D)
    self.eh_proj = param(rngs, (2 * D, D), (None, "embed"), cfg.init_std)  # rows: [embedding; hidden]
    self.block = Block(cfg, rngs, cfg.is_moe_layer(cfg.n_layers))  # the layer after the last one
    self.head_norm = norm(cfg, D)

  def __call__(self, h_BxLxD, next_emb_BxLxD, tables, seg_BxL):
    """(head-normed hidden (B, L, D) whose logits predict the token after next, the block's MoE stats or None)."""
    x_BxLx2D = jnp.concatenate([self.enorm(next_emb_BxLxD), self.hnorm(h_BxLxD)], axis=-1)
    x_BxLxD = ops.constrain(ops.matmul(x_BxLx2D, ops.weight(self.eh_proj, x_BxLx2D.dtype)), RESIDUAL)
    x_BxLxD, stats = self.block(x_BxLxD, tables, seg_BxL)
    return self.head_norm(x_BxLxD), stats


def trains(cfg) -> bool:
  """The module exists and its loss has a weight: it runs in training (else its parameters only sit there)."""
  return bool(cfg.mtp_layers and cfg.mtp_weight > 0)


def targets(mb):
  """(targets t_{i+2} (B, L), mask): position i counts where t_{i+1} and t_{i+2} both continue its document
  (the loss masks at i and i + 1); the last position has no t_{i+2} in the row."""
  t_BxL, m_BxL = mb["targets"], mb["loss_mask"]
  shift = lambda a: jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)  # noqa: E731
  return shift(t_BxL), m_BxL * shift(m_BxL)
