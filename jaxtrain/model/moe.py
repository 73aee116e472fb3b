"""The mixture-of-experts layer: float32 router, top-k (group-limited, bias-steered), capacity groups defined by the
data (G consecutive positions, the same tokens drop on every mesh), shared experts. Where the experts run (one
device, or dispatched over the `expert` axis) is `ops.experts`. B batch, L length, D d_model, X experts, F expert
width, k top_k."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import activation, ops
from jaxtrain.model.layers import MLP, param
from jaxtrain.model.lora import add_adapters, effective


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
  """Slots per expert and group: ceil(factor * G * k / X); factor 0 = G (never overflows)."""
  return tokens if factor == 0 else max(1, math.ceil(factor * tokens * top_k / experts))


def group_fits(G: int, L: int, b: int, n: int) -> bool:
  """A group lies within b rows x n positions: G divides n, or n = L and G is a multiple of L dividing b*L."""
  return n % G == 0 or (n == L and G % L == 0 and (b * L) % G == 0)


def group_size(cfg: ModelConfig, B: int, L: int, decoding: bool = False) -> int:
  """The capacity group in tokens for a (B, L) input: model.moe_group_size where it fits, else one row's L
  positions (decoding: a row's fed tokens are their own groups, so a prompt's output never depends on the batch)."""
  G = cfg.moe_group_size
  if not G or not group_fits(G, L, B, L) or (decoding and L % G):
    return L
  return G


def route(x_BxLxD, router_DxX, top_k: int, score: str = "softmax", bias_X=None, norm_top_k: bool = True,
          groups=(1, 1), scale: float = 1.0, logit_bias_X=None):
  """-> ids (B,L,k) int32, weights (B,L,k) f32 (summing to `scale` if norm_top_k, else the raw scores times
  `scale`), stats: balance, z, share f_e, prob P_e, load (X,). `groups` (n, best): choose among the `best` of n
  expert groups (ranked by their top-2 scores), DeepSeek-V3. `logit_bias_X`: a learned bias on the logits (GPT-OSS),
  unlike `bias_X` part of the scores and trained."""
  B, L, _ = x_BxLxD.shape
  X = router_DxX.shape[1]
  logits_BxLxX = jnp.einsum("bld,dx->blx", x_BxLxD.astype(jnp.float32), router_DxX.astype(jnp.float32))
  if logit_bias_X is not None:
    logits_BxLxX = logits_BxLxX + logit_bias_X.astype(jnp.float32)
  if score == "softmax":
    scores_BxLxX = probs_BxLxX = jax.nn.softmax(logits_BxLxX, axis=-1)
  else:  # sigmoid: independent per expert; P_e of the balance loss uses them normalized per token
    scores_BxLxX = jax.nn.sigmoid(logits_BxLxX)
    probs_BxLxX = scores_BxLxX / jnp.sum(scores_BxLxX, axis=-1, keepdims=True)
  pick = scores_BxLxX if bias_X is None else scores_BxLxX + jax.lax.stop_gradient(bias_X.astype(jnp.float32))
  if groups[0] > 1:
    pick = _group_limited(pick, *groups)
  _, idx_BxLxk = jax.lax.top_k(pick, top_k)
  w_BxLxk = jnp.take_along_axis(scores_BxLxX, idx_BxLxk, axis=-1)
  if norm_top_k:
    w_BxLxk = w_BxLxk / jnp.sum(w_BxLxk, axis=-1, keepdims=True)
  w_BxLxk = w_BxLxk * scale
  load_X = jnp.sum(jax.nn.one_hot(idx_BxLxk, X, dtype=jnp.float32), axis=(0, 1, 2))
  # means over the whole microbatch: the balance loss multiplies two of them
  share_X = ops.batch_mean(load_X / (B * L * top_k))
  prob_X = ops.batch_mean(jnp.mean(probs_BxLxX, axis=(0, 1)))
  stats = {"balance": X * jnp.sum(share_X * prob_X),
           "z": ops.batch_mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxX, axis=-1)))),
           "share": share_X, "prob": prob_X, "load": jax.lax.stop_gradient(load_X)}
  return idx_BxLxk, w_BxLxk, stats


def _group_limited(pick_BxLxX, n: int, best: int):
  """Scores outside a token's `best` groups (by the sum of each group's top-2 scores) set to -inf."""
  B, L, X = pick_BxLxX.shape
  g_BxLxnxm = pick_BxLxX.reshape(B, L, n, X // n)
  group_BxLxn = jnp.sum(jax.lax.top_k(g_BxLxnxm, min(2, X // n))[0], axis=-1)
  _, keep_BxLxb = jax.lax.top_k(group_BxLxn, best)
  keep_BxLxn = jnp.sum(jax.nn.one_hot(keep_BxLxb, n, dtype=jnp.int32), axis=-2) > 0
  return jnp.where(keep_BxLxn[..., None], g_BxLxnxm, -jnp.inf).reshape(B, L, X)


class MoE(nnx.Module):
  """X routed SwiGLU experts, optional shared experts (a dense MLP, its own LoRA adapters), and a gradient-free
  routing bias; returns (y, stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, X, std = cfg.d_model, cfg.moe_experts, cfg.init_std
    F = cfg.moe_expert_d_ff or cfg.d_ff
    self.router = param(rngs, (D, X), ("embed", None), std)
    self.w_gate = param(rngs, (X, D, F), ("experts", "embed", "mlp"), std)
    self.w_up = param(rngs, (X, D, F), ("experts", "embed", "mlp"), std)
    self.w_down = param(rngs, (X, F, D), ("experts", "mlp", "embed"), std)
    add_adapters(self, cfg, rngs, {"w_gate": 1, "w_up": 1, "w_down": 1}, n_batch=1)  # LoRA: one adapter an expert
    if cfg.moe_bias_rate > 0:
      self.router_bias = nnx.Param(jnp.zeros((X,), jnp.float32), axes=(None,))
    if cfg.moe_bias:  # GPT-OSS: zero at init, so a new model routes and computes as without them
      self.router_logit_bias = nnx.Param(jnp.zeros((X,), jnp.float32), axes=(None,))
      self.b_gate = nnx.Param(jnp.zeros((X, F), jnp.float32), axes=("experts", "mlp"))
      self.b_up = nnx.Param(jnp.zeros((X, F), jnp.float32), axes=("experts", "mlp"))
      self.b_down = nnx.Param(jnp.zeros((X, D), jnp.float32), axes=("experts", "embed"))
    if cfg.moe_shared_experts:
      self.shared = MLP(cfg, rngs, d_ff=cfg.moe_shared_experts * F)
    self.cfg = cfg

  def __call__(self, x_BxLxD, decoding: bool = False):
    dt, c = x_BxLxD.dtype, self.cfg
    B, L, _ = x_BxLxD.shape
    bias = jax.lax.stop_gradient(self.router_bias[...]) if c.moe_bias_rate > 0 else None
    idx, w, stats = route(x_BxLxD, self.router[...], c.moe_top_k, c.moe_router, bias, c.moe_norm_top_k,
                          (c.moe_n_group, c.moe_topk_group), c.moe_routed_scale,
                          self.router_logit_bias[...] if c.moe_bias else None)
    # LoRA: each expert's weight merged with its adapter (one layer's at a time), so the dispatch is the plain one
    weights = tuple(effective(self, attr, dt) for attr in ("w_gate", "w_up", "w_down"))
    if c.moe_bias:
      weights += tuple(getattr(self, b)[...].astype(dt) for b in ("b_gate", "b_up", "b_down"))
    G = group_size(c, B, L, decoding)
    cap = None if c.moe_dropless else capacity(G, c.moe_experts, c.moe_top_k, c.moe_capacity_factor)
    y_BxLxD, dropped = ops.current().experts(x_BxLxD, idx, w, weights, G, cap, activation.of(c))
    stats.update(dropped=jax.lax.stop_gradient(dropped), assigned=jnp.float32(B * L * c.moe_top_k))
    y_BxLxD = y_BxLxD.astype(dt)
    if c.moe_shared_experts:
      y_BxLxD = y_BxLxD + self.shared(x_BxLxD)
    return y_BxLxD, stats
