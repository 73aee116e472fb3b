"""One decoder block: pre-norm attention (grouped-query, or MLA) and a pre-norm MLP or MoE, residual adds.
B batch, L length, D d_model, H heads, K kv heads, E head_dim."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import ops
from jaxtrain.model.attention import cached_attention, max_logit, windowed_cached_attention
from jaxtrain.model.layers import MLP, layer_tables, norm, param, rope
from jaxtrain.model.lora import adapted, add_adapters
from jaxtrain.model.mla import MLA
from jaxtrain.model.moe import MoE

RESIDUAL = ("batch", "act_length", "act_embed")  # the residual stream between blocks
WHOLE = ("batch", "length", "act_embed")  # a norm's output entering a tensor-parallel region, whole along length


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, H, K, E, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
    self.wq = param(rngs, (D, H, E), ("embed", "heads", "head_dim"), std)
    self.wk = param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
    self.wv = param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
    self.wo = param(rngs, (H, E, D), ("heads", "head_dim", "embed"), std)
    add_adapters(self, cfg, rngs, {"wq": 1, "wk": 1, "wv": 1, "wo": 2})
    if cfg.qk_norm:  # Qwen3: one scale over head_dim shared by every head, so replicated under tensor
      self.q_norm, self.k_norm = norm(cfg, E), norm(cfg, E)
    if cfg.attention_bias:  # GPT-OSS: zero at init
      self.bq = nnx.Param(jnp.zeros((H, E), jnp.float32), axes=("heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((K, E), jnp.float32), axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((K, E), jnp.float32), axes=("kv_heads", "head_dim"))
      self.bo = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))  # replicated as a norm's scale
    if cfg.attention_sinks:  # GPT-OSS: zero at init, a sink as likely as a key scoring 0
      self.sinks = nnx.Param(jnp.zeros((H,), jnp.float32), axes=("sinks",))
    self.qk_norm, self.logits_dtype, self.bias = cfg.qk_norm, cfg.attention_logits_dtype, cfg.attention_bias
    # model.attention_scale: q scaled once here, so every kernel's own 1/sqrt(head_dim) gives that factor
    self.q_scale = cfg.attention_scale * E ** 0.5 if cfg.attention_scale else 1.0
    self.choices = cfg.window_choices()

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, cache=None, window=0):
    """With a KV `cache` (decoding) returns (output, updated {"k", "v"}). `window`: this layer's (cfg.layer_windows;
    traced in a scanned stack, where a stack of mixed layers picks its kernel by it)."""
    qkv = self.project(x_BxLxD, rope_tables)
    sinks_H = self.sinks[...] if hasattr(self, "sinks") else None
    if cache is not None:  # decoding: `window` is static (a stack of mixed layers decodes one layer at a time)
      cached = functools.partial(windowed_cached_attention, window=window) if window else cached_attention
      o_BxLxHxE, cache = cached(*qkv, seg_BxL, cache, sinks_H=sinks_H)
      return self.out(o_BxLxHxE), cache
    return self.out(checkpoint_name(self.attend(*qkv, seg_BxL, window, sinks_H), "attn_out"))

  def project(self, x_BxLxD, rope_tables):
    """(q, k, v) of the attention, RoPE applied."""
    dt = x_BxLxD.dtype
    q_BxLxHxE = adapted(self, "wq", x_BxLxD, ops.einsum("bld,dhe->blhe", x_BxLxD, ops.weight(self.wq, dt)))
    k_BxLxKxE = adapted(self, "wk", x_BxLxD, ops.einsum("bld,dke->blke", x_BxLxD, ops.weight(self.wk, dt)))
    v_BxLxKxE = adapted(self, "wv", x_BxLxD, ops.einsum("bld,dke->blke", x_BxLxD, ops.weight(self.wv, dt)))
    if self.bias:
      q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = (y + b[...].astype(dt) for y, b in (
          (q_BxLxHxE, self.bq), (k_BxLxKxE, self.bk), (v_BxLxKxE, self.bv)))
    if self.qk_norm:
      q_BxLxHxE, k_BxLxKxE = self.q_norm(q_BxLxHxE), self.k_norm(k_BxLxKxE)
    q_BxLxHxE = rope(q_BxLxHxE, rope_tables)
    if self.q_scale != 1.0:
      q_BxLxHxE = (q_BxLxHxE.astype(jnp.float32) * self.q_scale).astype(q_BxLxHxE.dtype)
    q_BxLxHxE = ops.constrain(q_BxLxHxE, ("batch", "length", "act_heads", None))
    k_BxLxKxE = ops.constrain(rope(k_BxLxKxE, rope_tables), ("batch", "length", "act_kv_heads", None))
    v_BxLxKxE = ops.constrain(v_BxLxKxE, ("batch", "length", "act_kv_heads", None))
    return checkpoint_name(q_BxLxHxE, "q"), checkpoint_name(k_BxLxKxE, "k"), checkpoint_name(v_BxLxKxE, "v")

  def attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, window, sinks_H):
    """The plan's kernel with this layer's window, static for it: the one window of the model, a Python int, or
    (a traced window of a stack of mixed layers) a switch among the model's windows."""
    kernel = lambda w: lambda *a: ops.current().attend(*a, self.logits_dtype, window=w, sinks_H=sinks_H)  # noqa: E731
    if len(self.choices) == 1 or isinstance(window, int):
      return kernel(self.choices[0] if len(self.choices) == 1 else window)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)
    branch = jnp.searchsorted(jnp.asarray(self.choices), window)
    return jax.lax.switch(branch, [kernel(w) for w in self.choices], q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)

  def out(self, o_BxLxHxE):
    wo = ops.weight(self.wo, o_BxLxHxE.dtype)
    y_BxLxD = adapted(self, "wo", o_BxLxHxE, ops.einsum("blhe,hed->bld", o_BxLxHxE, wo))
    return y_BxLxD + self.bo[...].astype(y_BxLxD.dtype) if self.bias else y_BxLxD


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe_layer: bool = False):
    self.attn_norm = norm(cfg)
    self.attn = MLA(cfg, rngs) if cfg.attention_type == "mla" else Attention(cfg, rngs)
    self.mlp_norm = norm(cfg)
    self.mlp = MoE(cfg, rngs) if moe_layer else MLP(cfg, rngs)
    if cfg.post_norms:  # Gemma 3: each sublayer's output normed before the residual add
      self.attn_post_norm, self.mlp_post_norm = norm(cfg), norm(cfg)
    self.windowed = cfg.sliding_window > 0

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, cache=None, window=0):
    """(x, MoE stats or None)[, updated KV cache]; `window`: the layer's attention window (0: global)."""
    h_BxLxD = ops.constrain(self.attn_norm(x_BxLxD), WHOLE)
    kw = {"window": window} if self.windowed else {}  # MLA has no window (the config refuses one)
    rope_tables = layer_tables(rope_tables, window)
    if cache is None:
      a_BxLxD = self.attn(h_BxLxD, rope_tables, seg_BxL, **kw)
    else:
      a_BxLxD, cache = self.attn(h_BxLxD, rope_tables, seg_BxL, cache, **kw)
    x_BxLxD = x_BxLxD + self.post(a_BxLxD, "attn_post_norm")
    out = self.ffn(ops.constrain(x_BxLxD, RESIDUAL), cache is not None)
    return out if cache is None else (*out, cache)

  def ffn(self, x_BxLxD, decoding: bool = False):
    """(x plus the MLP's (or MoE's) output, MoE stats or None)."""
    h_BxLxD = ops.constrain(self.mlp_norm(x_BxLxD), WHOLE)
    y_BxLxD, stats = self.mlp(h_BxLxD, decoding) if isinstance(self.mlp, MoE) else (self.mlp(h_BxLxD), None)
    return ops.constrain(x_BxLxD + self.post(y_BxLxD, "mlp_post_norm"), RESIDUAL), stats

  def post(self, y_BxLxD, name: str):
    """A sublayer's output as the residual adds it: normed by `name` with model.post_norms."""
    return getattr(self, name)(y_BxLxD) if hasattr(self, name) else y_BxLxD

  def probe(self, x_BxLxD, rope_tables, seg_BxL):
    """(the block's output, its attention's largest logit per head (H,)): QK-clip's forward, without gradient
    (grouped-query attention: core.checks.check_optim refuses MLA)."""
    qkv = self.attn.project(ops.constrain(self.attn_norm(x_BxLxD), WHOLE), rope_tables)  # no window, no sinks:
    a_BxLxD = self.post(self.attn.out(self.attn.attend(*qkv, seg_BxL, 0, None)), "attn_post_norm")  # refused
    x_BxLxD = ops.constrain(x_BxLxD + a_BxLxD, RESIDUAL)
    return self.ffn(x_BxLxD)[0], max_logit(qkv[0], qkv[1], seg_BxL)


def empty_cache(cfg: ModelConfig, batch: int, length: int, window: int = 0) -> dict:
  """One grouped-query layer's KV cache of `length` slots per row; a local layer's (`window` > 0) holds at most its
  window (a ring of the last `window` slots)."""
  shape = (batch, min(length, window) if window else length, cfg.n_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}
