"""A Llama-shaped decoder-only transformer in Flax NNX: plain math, logical axes only (`axes` metadata); attention,
MoE and annotations go through the plan. B batch, L length, D d_model, H heads, K kv heads, E head_dim, F d_ff,
V vocab."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.core.config import ModelConfig
from jaxtrain.model import fp8, mla as mla_lib, mtp as mtp_lib, rope as rope_scaling
from jaxtrain.model.attention import cached_attention
from jaxtrain.parallel import plan as plan_lib

NAMED = ("q", "k", "v", "attn_out", "mlp_hidden")


def remat_policy(name: str):
  """model.remat -> (use jax.checkpoint, its policy). `none` saves everything autodiff wants."""
  cp = jax.checkpoint_policies
  return {
      "none": (False, None),
      "full": (True, cp.nothing_saveable),
      "save_dots": (True, cp.dots_with_no_batch_dims_saveable),  # projections, not the L x L scores
      "save_named": (True, cp.save_only_these_names(*NAMED)),
      "offload_named": (True, cp.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=list(NAMED),
          offload_src="device", offload_dst="pinned_host")),
  }[name]


def _param(rngs: nnx.Rngs, shape, axes, std: float) -> nnx.Param:
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=("norm",))
    self.eps = eps

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(x_BxLxD.dtype)


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


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, H, K, E, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
    self.wq = _param(rngs, (D, H, E), ("embed", "heads", "head_dim"), std)
    self.wk = _param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
    self.wv = _param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
    self.wo = _param(rngs, (H, E, D), ("heads", "head_dim", "embed"), std)
    if cfg.qk_norm:  # Qwen3: one scale over head_dim shared by every head, so replicated under tensor
      self.q_norm, self.k_norm = RMSNorm(E, cfg.norm_eps), RMSNorm(E, cfg.norm_eps)
    self.qk_norm = cfg.qk_norm

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, plan, cache=None):
    """With a KV `cache` (decoding) returns (output, updated {"k", "v"})."""
    dt = x_BxLxD.dtype
    q_BxLxHxE = fp8.einsum(plan.fp8, "bld,dhe->blhe", x_BxLxD, self.wq[...].astype(dt))
    k_BxLxKxE = fp8.einsum(plan.fp8, "bld,dke->blke", x_BxLxD, self.wk[...].astype(dt))
    v_BxLxKxE = fp8.einsum(plan.fp8, "bld,dke->blke", x_BxLxD, self.wv[...].astype(dt))
    if self.qk_norm:
      q_BxLxHxE, k_BxLxKxE = self.q_norm(q_BxLxHxE), self.k_norm(k_BxLxKxE)
    q_BxLxHxE = plan.constrain(rope(q_BxLxHxE, rope_tables), ("batch", "length", "act_heads", None))
    k_BxLxKxE = plan.constrain(rope(k_BxLxKxE, rope_tables), ("batch", "length", "act_kv_heads", None))
    v_BxLxKxE = plan.constrain(v_BxLxKxE, ("batch", "length", "act_kv_heads", None))
    qkv = checkpoint_name(q_BxLxHxE, "q"), checkpoint_name(k_BxLxKxE, "k"), checkpoint_name(v_BxLxKxE, "v")
    if cache is not None:
      o_BxLxHxE, cache = cached_attention(*qkv, seg_BxL, cache)
      return fp8.einsum(plan.fp8, "blhe,hed->bld", o_BxLxHxE, self.wo[...].astype(dt)), cache
    o_BxLxHxE = checkpoint_name(plan.attend(*qkv, seg_BxL), "attn_out")
    return fp8.einsum(plan.fp8, "blhe,hed->bld", o_BxLxHxE, self.wo[...].astype(dt))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
    D, F, std = cfg.d_model, d_ff or cfg.d_ff, cfg.init_std
    self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_up = _param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_down = _param(rngs, (F, D), ("mlp", "embed"), std)

  def __call__(self, x_BxLxD, plan):
    dt = x_BxLxD.dtype
    g_BxLxF = fp8.matmul(plan.fp8, jnp.matmul, x_BxLxD, self.w_gate[...].astype(dt))
    u_BxLxF = fp8.matmul(plan.fp8, jnp.matmul, x_BxLxD, self.w_up[...].astype(dt))
    h_BxLxF = plan.constrain(jax.nn.silu(g_BxLxF) * u_BxLxF, ("batch", "length", "act_mlp"))
    h_BxLxF = checkpoint_name(h_BxLxF, "mlp_hidden")
    return fp8.matmul(plan.fp8, jnp.matmul, h_BxLxF, self.w_down[...].astype(dt))


class MoE(nnx.Module):
  """X routed SwiGLU experts, optional shared experts, and a gradient-free routing bias; returns (y, stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, X, std = cfg.d_model, cfg.moe_experts, cfg.init_std
    F = cfg.moe_expert_d_ff or cfg.d_ff
    self.router = _param(rngs, (D, X), ("embed", None), std)
    self.w_gate = _param(rngs, (X, D, F), ("experts", "embed", "mlp"), std)
    self.w_up = _param(rngs, (X, D, F), ("experts", "embed", "mlp"), std)
    self.w_down = _param(rngs, (X, F, D), ("experts", "mlp", "embed"), std)
    if cfg.moe_bias_rate > 0:
      self.router_bias = nnx.Param(jnp.zeros((X,), jnp.float32), axes=(None,))
    if cfg.moe_shared_experts:
      self.shared = MLP(cfg, rngs, d_ff=cfg.moe_shared_experts * F)
    self.cfg = cfg

  def __call__(self, x_BxLxD, plan):
    dt, c = x_BxLxD.dtype, self.cfg
    bias = jax.lax.stop_gradient(self.router_bias[...]) if c.moe_bias_rate > 0 else None
    y_BxLxD, stats = plan.moe_ffn(x_BxLxD, self.router[...], self.w_gate[...].astype(dt), self.w_up[...].astype(dt),
                                  self.w_down[...].astype(dt), top_k=c.moe_top_k,
                                  capacity_factor=c.moe_capacity_factor, score=c.moe_router, bias_X=bias,
                                  norm_top_k=c.moe_norm_top_k, groups=(c.moe_n_group, c.moe_topk_group),
                                  scale=c.moe_routed_scale)
    if c.moe_shared_experts:
      y_BxLxD = y_BxLxD + self.shared(x_BxLxD, plan)
    return y_BxLxD, stats


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe_layer: bool = False):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = mla_lib.MLA(cfg, rngs, RMSNorm, rope) if cfg.attention_type == "mla" else Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = MoE(cfg, rngs) if moe_layer else MLP(cfg, rngs)

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, plan, cache=None):
    """(x, MoE stats or None)[, updated KV cache]; each norm's output enters a TP region whole along `length`."""
    h_BxLxD = plan.constrain(self.attn_norm(x_BxLxD), ("batch", "length", "act_embed"))
    if cache is None:
      x_BxLxD = x_BxLxD + self.attn(h_BxLxD, rope_tables, seg_BxL, plan)
    else:
      a_BxLxD, cache = self.attn(h_BxLxD, rope_tables, seg_BxL, plan, cache)
      x_BxLxD = x_BxLxD + a_BxLxD
    x_BxLxD = plan.constrain(x_BxLxD, ("batch", "act_length", "act_embed"))
    h_BxLxD = plan.constrain(self.mlp_norm(x_BxLxD), ("batch", "length", "act_embed"))
    y_BxLxD, stats = self.mlp(h_BxLxD, plan) if isinstance(self.mlp, MoE) else (self.mlp(h_BxLxD, plan), None)
    out = plan.constrain(x_BxLxD + y_BxLxD, ("batch", "act_length", "act_embed")), stats
    return out if cache is None else (*out, cache)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
    blocks = [Block(cfg, rngs, cfg.is_moe_layer(i)) for i in range(cfg.n_layers)]
    if cfg.scan_layers:  # `layers`, after a `dense_layers` stack of the dense first layers (cfg.stacks)
      for name, idx in cfg.stacks().items():
        setattr(self, name, stack_blocks(blocks[idx.start:idx.stop]))
    else:
      self.layers = nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
    if cfg.mtp_layers:
      self.mtp = mtp_lib.MTP(cfg, rngs, Block, RMSNorm)

  def __call__(self, tokens_BxL, pos_BxL, seg_BxL, plan=None):
    """float32 logits (B, L, V). `plan` None = one device, reference attention."""
    plan = plan or plan_lib.local(self.cfg)
    x_BxLxD, _ = self.hidden(tokens_BxL, pos_BxL, seg_BxL, plan)
    return plan.constrain(self._logits(x_BxLxD), ("batch", "length", "act_vocab"))

  def head_weight(self):
    """The output projection (D, V), float32: the embedding's transpose when tied."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def _logits(self, x_BxLxD):
    return jnp.einsum("bld,dv->blv", x_BxLxD, self.head_weight().astype(x_BxLxD.dtype),
                      preferred_element_type=jnp.float32)

  def _embed(self, tokens_BxL, plan):
    # Looked up from the fsdp-sharded table as stored: rows come out split over fsdp on D and XLA moves them to the
    # batch split (on CPU it warns of a full rematerialization there). Gathering the table first silences that
    # but moves the whole float32 table and its gradient every step (2 x 2 GiB at 8B), far more than the rows.
    x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(jnp.dtype(self.cfg.dtype))
    return plan.constrain(x_BxLxD, ("batch", "act_length", "act_embed"))

  def hidden(self, tokens_BxL, pos_BxL, seg_BxL, plan=None):
    """(final-normed hidden states (B, L, D), list of MoE layers' stats): the forward pass without the head."""
    plan = plan or plan_lib.local(self.cfg)
    x_BxLxD = self._embed(tokens_BxL, plan)
    tables = rope_tables(pos_BxL, self.cfg)
    moe_stats = []
    use_remat, policy = remat_policy(self.cfg.remat)
    _run_block = lambda block, x_BxLxD, tables, seg_BxL: block(x_BxLxD, tables, seg_BxL, plan)  # noqa: E731
    # prevent_cse is only needed outside a scan (scan already keeps the recomputation apart)
    run_block = nnx.remat(_run_block, policy=policy, prevent_cse=not self.cfg.scan_layers) if use_remat else _run_block
    if self.cfg.scan_layers:
      for name in self.cfg.stacks():
        x_BxLxD, stats = _scan_blocks(run_block, getattr(self, name), x_BxLxD, tables, seg_BxL)
        moe_stats += stats
    else:
      for block in self.layers:
        x_BxLxD, stats = run_block(block, x_BxLxD, tables, seg_BxL)
        if stats is not None:
          moe_stats.append(stats)
    return self.final_norm(x_BxLxD), moe_stats

  def decode(self, tokens_BxT, pos_BxT, seg_BxT, cache, plan=None):
    """KV-cached forward of T new tokens into cache slots [start, start+T): (float32 logits (B, T, V), cache)."""
    plan = plan or plan_lib.local(self.cfg)
    # a row's fed tokens are its own capacity group(s): a prompt's output must not depend on the rest of the batch
    T, G = tokens_BxT.shape[1], plan.moe_group
    plan = dataclasses.replace(plan, moe_group=G if G and T % G == 0 else 0)
    x_BxTxD = self._embed(tokens_BxT, plan)
    tables = rope_tables(pos_BxT, self.cfg)
    start = cache["start"]
    kv_seg_BxS = jax.lax.dynamic_update_slice(cache["seg"], seg_BxT.astype(cache["seg"].dtype), (0, start))
    shared = {"seg": kv_seg_BxS, "start": start}
    new = {}
    if self.cfg.scan_layers:
      for name in self.cfg.stacks():
        graphdef, state = nnx.split(getattr(self, name))

        def body(x, layer, graphdef=graphdef):
          x, _, kv = nnx.merge(graphdef, layer[0])(x, tables, seg_BxT, plan, {**layer[1], **shared})
          return x, kv
        x_BxTxD, new[name] = jax.lax.scan(body, x_BxTxD, (state, cache[name]))
    else:
      new["layers"] = []
      for block, kv in zip(self.layers, cache["layers"]):
        x_BxTxD, _, kv = block(x_BxTxD, tables, seg_BxT, plan, {**kv, **shared})
        new["layers"].append(kv)
    logits_BxTxV = self._logits(self.final_norm(x_BxTxD))
    return logits_BxTxV, {**new, "seg": kv_seg_BxS, "start": start + tokens_BxT.shape[1]}


def init_cache(cfg: ModelConfig, batch: int, length: int):
  """An empty KV cache of `length` slots per row for `Transformer.decode` (segment id 0 = empty)."""
  kv = lambda: {"k": jnp.zeros((batch, length, cfg.n_kv_heads, cfg.head_dim), cfg.dtype),  # noqa: E731
                "v": jnp.zeros((batch, length, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)}
  if cfg.attention_type == "mla":
    kv = lambda: mla_lib.empty_cache(cfg, batch, length)  # noqa: E731
  stacks = {"layers": [kv() for _ in range(cfg.n_layers)]} if not cfg.scan_layers else {
      name: jax.tree.map(lambda a, n=len(idx): jnp.broadcast_to(a, (n, *a.shape)), kv())
      for name, idx in cfg.stacks().items()}
  return {**stacks, "seg": jnp.zeros((batch, length), jnp.int32), "start": jnp.zeros((), jnp.int32)}


def stack_blocks(blocks: list[Block]) -> Block:
  """One Block whose every parameter has a leading `layers` axis: layer i holds `blocks[i]`'s parameters."""
  graphdef = nnx.split(blocks[0])[0]
  states = [nnx.split(b)[1] for b in blocks]
  stacked = jax.tree.map(lambda *vs: jnp.stack(vs), *states)
  block = nnx.merge(graphdef, stacked)
  for _, var in nnx.iter_graph(block):
    if isinstance(var, nnx.Param):
      var.set_metadata(axes=("layers", *var.get_metadata()["axes"]))
  return block


def _scan_blocks(run_block, stacked: Block, x_BxLxD, tables, seg_BxL):
  """jax.lax.scan over the `layers` axis: one traced block, applied n_layers times."""
  graphdef, state = nnx.split(stacked)

  body = lambda x, layer_state: run_block(nnx.merge(graphdef, layer_state), x, tables, seg_BxL)  # noqa: E731
  x_BxLxD, stats = jax.lax.scan(body, x_BxLxD, state)
  n = jax.tree.leaves(state)[0].shape[0]
  return x_BxLxD, ([] if stats is None else [jax.tree.map(lambda a, i=i: a[i], stats) for i in range(n)])


def abstract(cfg: ModelConfig, seed: int = 0):
  """(graphdef, abstract nnx.State) without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))


def param_count(abstract_state) -> int:
  return sum(x.size for x in jax.tree.leaves(abstract_state))
