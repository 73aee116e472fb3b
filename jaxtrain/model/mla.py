"""Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank projection, keys and values
from one compressed latent C (plus a RoPE key part R shared by every head). Training expands the latent to per-head
k/v and calls ops' attention kernel; decoding caches only (latent, RoPE key) per token and attends in latent space with the
up-projections absorbed into q and the output. B batch, L length, D d_model, H heads, Q q_lora_rank,
C kv_lora_rank, N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, S cache slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.model import ops, rope as rope_lib
from jaxtrain.model.attention import NEG_INF
from jaxtrain.model.layers import norm, param as _param, rope
from jaxtrain.model.lora import adapted, add_adapters, effective

LATENT_EPS = 1e-6  # the latent norms keep DeepSeek's eps whatever model.norm_eps says (as transformers does)


class MLA(nnx.Module):
  """Every projection (wq or wq_a/wq_b, wkv_a, wkv_b, wo) runs as ops says (FP8 included), with its LoRA adapter
  (targets q or q_a/q_b, kv_a, kv_b, o) beside it; decoding's absorbed latent-space products are float32 math of the
  cached latent, wkv_b's adapter merged into it."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    D, H, Q, C, std = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.init_std
    # The latent (Q, C) dimension of the up-projections is stored split like d_model (FSDP): with heads unsplit
    # (no tensor axis) they would otherwise be whole on every device.
    N, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if Q:
      self.wq_a = _param(rngs, (D, Q), ("embed", None), std)
      self.q_norm = norm(cfg, Q, LATENT_EPS)
      self.wq_b = _param(rngs, (Q, H, N + R), ("embed", "heads", "head_dim"), std)
    else:
      self.wq = _param(rngs, (D, H, N + R), ("embed", "heads", "head_dim"), std)
    self.wkv_a = _param(rngs, (D, C + R), ("embed", None), std)
    self.kv_norm = norm(cfg, C, LATENT_EPS)
    self.wkv_b = _param(rngs, (C, H, N + V), ("embed", "heads", "head_dim"), std)
    self.wo = _param(rngs, (H, V, D), ("heads", "head_dim", "embed"), std)
    add_adapters(self, cfg, rngs, {"wq": 1, "wq_a": 1, "wq_b": 1, "wkv_a": 1, "wkv_b": 1, "wo": 2})
    self.dims = (N, R, C)
    self.scale = rope_lib.softmax_scale(cfg)  # YaRN's mscale^2 on the usual (N + R)^-0.5
    self.logits_dtype = cfg.attention_logits_dtype

  def _q_and_latent(self, x_BxLxD, tables):
    """(q nope part (B,L,H,N), RoPE'd q part (B,L,H,R), normed latent (B,L,C), RoPE'd key part (B,L,R))."""
    N, _, C = self.dims
    dt = x_BxLxD.dtype
    if hasattr(self, "wq_a"):
      q_BxLxQ = self.q_norm(adapted(self, "wq_a", x_BxLxD, ops.matmul(x_BxLxD, ops.weight(self.wq_a, dt))))
      q_BxLxHxE = adapted(self, "wq_b", q_BxLxQ, ops.einsum("blq,qhe->blhe", q_BxLxQ, ops.weight(self.wq_b, dt)))
    else:
      q_BxLxHxE = adapted(self, "wq", x_BxLxD, ops.einsum("bld,dhe->blhe", x_BxLxD, ops.weight(self.wq, dt)))
    kv_BxLxCR = adapted(self, "wkv_a", x_BxLxD, ops.matmul(x_BxLxD, ops.weight(self.wkv_a, dt)))
    c_BxLxC = self.kv_norm(kv_BxLxCR[..., :C])
    k_rot_BxLxR = rope(kv_BxLxCR[..., None, C:], tables)[:, :, 0]
    return q_BxLxHxE[..., :N], rope(q_BxLxHxE[..., N:], tables), c_BxLxC, k_rot_BxLxR

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, cache=None):
    """As Attention: the attention output (B, L, D); with a latent `cache`, (output, updated cache)."""
    N, R, C = self.dims
    dt = x_BxLxD.dtype
    q_nope_BxLxHxN, q_rot_BxLxHxR, c_BxLxC, k_rot_BxLxR = self._q_and_latent(x_BxLxD, rope_tables)
    if cache is not None:
      o_BxLxHxV, cache = self._decode(q_nope_BxLxHxN, q_rot_BxLxHxR, c_BxLxC, k_rot_BxLxR, seg_BxL, cache)
      return self.out(o_BxLxHxV), cache
    kv_BxLxHxNV = adapted(self, "wkv_b", c_BxLxC, ops.einsum("blc,che->blhe", c_BxLxC, ops.weight(self.wkv_b, dt)))
    H = kv_BxLxHxNV.shape[2]
    k_BxLxHxE = jnp.concatenate(
        [kv_BxLxHxNV[..., :N], jnp.broadcast_to(k_rot_BxLxR[:, :, None], (*k_rot_BxLxR.shape[:2], H, R))], axis=-1)
    q_BxLxHxE = jnp.concatenate([q_nope_BxLxHxN, q_rot_BxLxHxR], axis=-1)
    if self.scale != 1.0:  # the kernels scale by E^-0.5; YaRN's extra factor rides on q
      q_BxLxHxE = q_BxLxHxE * jnp.asarray(self.scale, dt)
    heads = ("batch", "length", "act_heads", None)
    q_BxLxHxE, k_BxLxHxE = ops.constrain(q_BxLxHxE, heads), ops.constrain(k_BxLxHxE, heads)
    v_BxLxHxV = ops.constrain(kv_BxLxHxNV[..., N:], heads)
    qkv = checkpoint_name(q_BxLxHxE, "q"), checkpoint_name(k_BxLxHxE, "k"), checkpoint_name(v_BxLxHxV, "v")
    o_BxLxHxV = checkpoint_name(ops.current().attend(*qkv, seg_BxL, self.logits_dtype), "attn_out")
    return self.out(o_BxLxHxV)

  def out(self, o_BxLxHxV):
    return adapted(self, "wo", o_BxLxHxV, ops.einsum("blhv,hvd->bld", o_BxLxHxV, ops.weight(self.wo, o_BxLxHxV.dtype)))

  def _decode(self, q_nope_BxTxHxN, q_rot_BxTxHxR, c_BxTxC, k_rot_BxTxR, seg_BxT, cache):
    """Writes this chunk's latent and RoPE key at slot `start`, then attends over the cache in latent space:
    q_nope @ W_uk scores against the latent itself, and the latent-space output goes through W_uv."""
    N, R, C = self.dims
    start = cache["start"]
    c_BxSxC = jax.lax.dynamic_update_slice(cache["c"], c_BxTxC.astype(cache["c"].dtype), (0, start, 0))
    k_rot_BxSxR = jax.lax.dynamic_update_slice(cache["k_rot"], k_rot_BxTxR.astype(cache["k_rot"].dtype), (0, start, 0))
    w_CxHxNV = effective(self, "wkv_b", jnp.float32)  # LoRA: absorbed merged, as the training path's x A B adds
    q_lat_BxTxHxC = jnp.einsum("bthn,chn->bthc", q_nope_BxTxHxN.astype(jnp.float32), w_CxHxNV[..., :N])
    s_BxHxTxS = (jnp.einsum("bthc,bsc->bhts", q_lat_BxTxHxC, c_BxSxC.astype(jnp.float32))
                 + jnp.einsum("bthr,bsr->bhts", q_rot_BxTxHxR.astype(jnp.float32), k_rot_BxSxR.astype(jnp.float32)))
    s_BxHxTxS = s_BxHxTxS * ((N + R) ** -0.5 * self.scale)
    T, S = q_nope_BxTxHxN.shape[1], c_BxSxC.shape[1]
    causal_TxS = jnp.arange(S)[None, :] <= start + jnp.arange(T)[:, None]
    same_BxTxS = seg_BxT[:, :, None] == cache["seg"][:, None, :]
    s_BxHxTxS = jnp.where((causal_TxS & same_BxTxS)[:, None], s_BxHxTxS, NEG_INF)
    p_BxHxTxS = jax.nn.softmax(s_BxHxTxS, axis=-1)
    o_lat_BxTxHxC = jnp.einsum("bhts,bsc->bthc", p_BxHxTxS, c_BxSxC.astype(jnp.float32))
    o_BxTxHxV = jnp.einsum("bthc,chv->bthv", o_lat_BxTxHxC, w_CxHxNV[..., N:]).astype(q_nope_BxTxHxN.dtype)
    return o_BxTxHxV, {"c": c_BxSxC, "k_rot": k_rot_BxSxR}


def empty_cache(cfg, batch: int, length: int) -> dict:
  """One layer's latent cache: (latent, RoPE key) per slot, kv_lora_rank + qk_rope_head_dim values a token."""
  return {"c": jnp.zeros((batch, length, cfg.kv_lora_rank), cfg.dtype),
          "k_rot": jnp.zeros((batch, length, cfg.qk_rope_head_dim), cfg.dtype)}


def attention_matmul_params(cfg) -> int:
  """Projection weights a token passes through in one MLA layer (for model FLOPs)."""
  D, H, Q, C = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  N, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  q = D * Q + Q * H * (N + R) if Q else D * H * (N + R)
  return q + D * (C + R) + C * H * (N + V) + H * V * D
