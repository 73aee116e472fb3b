"""Multi-token prediction (DeepSeek-V3), depth 1: at position i the main model's final-normed hidden state h_i and
the embedding of the next token t_{i+1} (both RMS-normed, concatenated, projected back to d_model by eh_proj) go
through one more decoder layer; its output, normed by the module's own head norm, meets the main model's output
head (shared, as the embedding is) to predict t_{i+2}. Training adds train.mtp_weight x its mean cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.model import loss as xent


class MTP(nnx.Module):
  """`block` and `norm`: the transformer's Block and RMSNorm classes (passed in: model/ has no cycles)."""

  def __init__(self, cfg, rngs: nnx.Rngs, block, norm):
    Block, RMSNorm, D = block, norm, cfg.d_model
    self.enorm, self.hnorm = RMSNorm(D, cfg.norm_eps), RMSNorm(D, cfg.norm_eps)
    eh_2DxD = 2 * D, D
    self.eh_proj = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), eh_2DxD, jnp.float32),
                             axes=(None, "embed"))  # rows: [embedding; hidden]
    self.block = Block(cfg, rngs, cfg.is_moe_layer(cfg.n_layers))  # the layer after the last one
    self.head_norm = RMSNorm(D, cfg.norm_eps)

  def __call__(self, h_BxLxD, next_emb_BxLxD, tables, seg_BxL, plan):
    """(head-normed hidden (B, L, D) whose logits predict the token after next, the block's MoE stats or None)."""
    x_BxLx2D = jnp.concatenate([self.enorm(next_emb_BxLxD), self.hnorm(h_BxLxD)], axis=-1)
    x_BxLxD = plan.constrain(x_BxLx2D @ self.eh_proj[...].astype(x_BxLx2D.dtype), ("batch", "act_length", "act_embed"))
    x_BxLxD, stats = self.block(x_BxLxD, tables, seg_BxL, plan)
    return self.head_norm(x_BxLxD), stats


def targets(mb):
  """(targets t_{i+2} (B, L), mask): position i counts where t_{i+1} and t_{i+2} both continue its document
  (the loss masks at i and i + 1); the last position has no t_{i+2} in the row."""
  t_BxL, m_BxL = mb["targets"], mb["loss_mask"]
  shift = lambda a: jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)  # noqa: E731
  return shift(t_BxL), m_BxL * shift(m_BxL)


def loss_sum(model, h_BxLxD, mb, tables, plan):
  """(Summed MTP cross-entropy over `targets`' mask, the MTP block's MoE stats or None) of one microbatch; `tables`:
  the forward pass's RoPE tables."""
  t2_BxL, m2_BxL = targets(mb)
  next_emb_BxLxD = model._embed(mb["targets"], plan)
  g_BxLxD, stats = model.mtp(h_BxLxD, next_emb_BxLxD, tables, mb["segment_ids"], plan)
  return xent.nll_sum(g_BxLxD, model.head_weight(), t2_BxL, m2_BxL, plan, plan.loss_chunk_tokens), stats
