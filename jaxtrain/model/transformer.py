"""A Llama-shaped decoder-only transformer in Flax NNX. Plain math, logical axes only.

Tensors are named with their shape: B batch, L length, D d_model, H query heads,
K kv heads, G = H/K queries per kv head, E head_dim, F d_ff, V vocab.
Parameters carry their logical axes in the `axes` metadata; `jaxtrain.parallel.sharding` maps
those to the mesh. Nothing here names a mesh axis or calls a collective: activations are
annotated, attention run and MoE tokens dispatched through the execution plan
(`jaxtrain.parallel.plan`) that the caller passes in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.parallel import plan as plan_lib
from jaxtrain.model import rope as rope_scaling
from jaxtrain.model.attention import attention, cached_attention, masked_attention  # noqa: F401 (the reference kernels)
from jaxtrain.core.config import ModelConfig

# Tensors named for the save_named / offload_named remat policies.
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


def rope_tables(pos_BxL, head_dim: int, theta: float, freq_E2=None):
  """(sin, cos) of the rotary angles, each (B, L, 1, E/2) float32 (the 1 broadcasts over
  heads): computed once per forward pass and shared by every layer, so neither each layer
  nor remat recomputes them, and the backward pass keeps one copy. `freq_E2` overrides
  the plain frequencies (model.rope_scaling)."""
  half = head_dim // 2
  if freq_E2 is None:
    freq_E2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  ang_BxLx1xE2 = (pos_BxL.astype(jnp.float32)[:, :, None] * freq_E2)[:, :, None, :]
  return jnp.sin(ang_BxLx1xE2), jnp.cos(ang_BxLx1xE2)


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

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, plan, cache=None):
    """With a KV `cache` (decoding) returns (output, updated {"k", "v"})."""
    dt = x_BxLxD.dtype
    q = jnp.einsum("bld,dhe->blhe", x_BxLxD, self.wq[...].astype(dt))
    k = jnp.einsum("bld,dke->blke", x_BxLxD, self.wk[...].astype(dt))
    v = jnp.einsum("bld,dke->blke", x_BxLxD, self.wv[...].astype(dt))
    q = checkpoint_name(plan.constrain(rope(q, rope_tables), ("batch", "length", "act_heads", None)), "q")
    k = checkpoint_name(plan.constrain(rope(k, rope_tables), ("batch", "length", "act_kv_heads", None)), "k")
    v = checkpoint_name(plan.constrain(v, ("batch", "length", "act_kv_heads", None)), "v")
    if cache is not None:
      o_BxLxHxE, cache = cached_attention(q, k, v, seg_BxL, cache)
      return jnp.einsum("blhe,hed->bld", o_BxLxHxE, self.wo[...].astype(dt)), cache
    o_BxLxHxE = checkpoint_name(plan.attend(q, k, v, seg_BxL), "attn_out")
    return jnp.einsum("blhe,hed->bld", o_BxLxHxE, self.wo[...].astype(dt))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
    D, F, std = cfg.d_model, d_ff or cfg.d_ff, cfg.init_std
    self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_up = _param(rngs, (D, F), ("embed", "mlp"), std)
    self.w_down = _param(rngs, (F, D), ("mlp", "embed"), std)

  def __call__(self, x_BxLxD, plan):
    dt = x_BxLxD.dtype
    g_BxLxF = x_BxLxD @ self.w_gate[...].astype(dt)
    u_BxLxF = x_BxLxD @ self.w_up[...].astype(dt)
    h_BxLxF = plan.constrain(jax.nn.silu(g_BxLxF) * u_BxLxF, ("batch", "length", "act_mlp"))
    h_BxLxF = checkpoint_name(h_BxLxF, "mlp_hidden")
    return h_BxLxF @ self.w_down[...].astype(dt)


class MoE(nnx.Module):
  """Mixture of X SwiGLU experts with a float32 top-k router (routing math in `jaxtrain.parallel.experts`),
  plus optional always-on shared experts and a routing bias (aux-loss-free balancing: it
  gets no gradient; `moe_balance.nudge` moves it after each update).

  Returns (y, stats) where stats are this layer's auxiliary-loss terms, expert load and
  drop counts (`moe_balance` combines them over layers).
  """

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
                                  capacity_factor=c.moe_capacity_factor, score=c.moe_router, bias_X=bias)
    if c.moe_shared_experts:
      y_BxLxD = y_BxLxD + self.shared(x_BxLxD, plan)
    return y_BxLxD, stats


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe_layer: bool = False):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = MoE(cfg, rngs) if moe_layer else MLP(cfg, rngs)

  def __call__(self, x_BxLxD, rope_tables, seg_BxL, plan, cache=None):
    """Returns (x, MoE stats or None), and the updated KV cache when given one. The residual
    stream is `act_length`; each norm's output enters a tensor-parallel region whole along `length`."""
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
    self.layers = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

  def __call__(self, tokens_BxL, pos_BxL, seg_BxL, plan=None):
    """Returns float32 logits (B, L, V)."""
    return self.forward(tokens_BxL, pos_BxL, seg_BxL, plan)[0]

  def forward(self, tokens_BxL, pos_BxL, seg_BxL, plan=None):
    """Returns (float32 logits (B, L, V), list of the MoE layers' stats; empty if dense).
    `plan`: how to run on the mesh (`jaxtrain.parallel.plan`); None = one device, reference attention."""
    plan = plan or plan_lib.local(self.cfg)
    x_BxLxD, moe_stats = self.hidden(tokens_BxL, pos_BxL, seg_BxL, plan)
    logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, self.head_weight().astype(x_BxLxD.dtype),
                              preferred_element_type=jnp.float32)
    return plan.constrain(logits_BxLxV, ("batch", "length", "act_vocab")), moe_stats

  def head_weight(self):
    """The output projection (D, V), float32: the embedding's transpose when tied."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def hidden(self, tokens_BxL, pos_BxL, seg_BxL, plan=None):
    """(final-normed hidden states (B, L, D) in the compute dtype, MoE stats): `forward`
    without the output head, for a loss that applies the head itself (`jaxtrain.model.loss`)."""
    plan = plan or plan_lib.local(self.cfg)
    dt = jnp.dtype(self.cfg.dtype)
    x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(dt)
    x_BxLxD = plan.constrain(x_BxLxD, ("batch", "act_length", "act_embed"))
    tables = rope_tables(pos_BxL, self.cfg.head_dim, self.cfg.rope_theta, _freq(self.cfg))
    moe_stats = []
    use_remat, policy = remat_policy(self.cfg.remat)

    def _run_block(block, x_BxLxD, tables, seg_BxL):
      return block(x_BxLxD, tables, seg_BxL, plan)

    # prevent_cse is only needed outside a scan (scan already keeps the recomputation apart)
    run_block = nnx.remat(_run_block, policy=policy, prevent_cse=not self.cfg.scan_layers) if use_remat else _run_block
    if self.cfg.scan_layers:
      x_BxLxD, moe_stats = _scan_blocks(run_block, self.layers, x_BxLxD, tables, seg_BxL)
    else:
      for block in self.layers:
        x_BxLxD, stats = run_block(block, x_BxLxD, tables, seg_BxL)
        if stats is not None:
          moe_stats.append(stats)
    return self.final_norm(x_BxLxD), moe_stats

  def decode(self, tokens_BxT, pos_BxT, seg_BxT, cache, plan=None):
    """KV-cached forward of T new tokens per row (the prompt, then one at a time) through the
    same blocks. `cache` from `init_cache`; its slots [start, start+T) receive these tokens.
    Returns (float32 logits (B, T, V), updated cache)."""
    plan = plan or plan_lib.local(self.cfg)
    dt = jnp.dtype(self.cfg.dtype)
    x_BxTxD = plan.constrain(jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt),
                             ("batch", "act_length", "act_embed"))
    tables = rope_tables(pos_BxT, self.cfg.head_dim, self.cfg.rope_theta, _freq(self.cfg))
    start = cache["start"]
    kv_seg_BxS = jax.lax.dynamic_update_slice(cache["seg"], seg_BxT.astype(cache["seg"].dtype), (0, start))
    shared = {"seg": kv_seg_BxS, "start": start}
    if self.cfg.scan_layers:
      graphdef, state = nnx.split(self.layers)

      def body(x, layer):
        x, _, kv = nnx.merge(graphdef, layer[0])(x, tables, seg_BxT, plan, {**layer[1], **shared})
        return x, kv
      x_BxTxD, layers = jax.lax.scan(body, x_BxTxD, (state, cache["layers"]))
    else:
      layers = []
      for block, kv in zip(self.layers, cache["layers"]):
        x_BxTxD, _, kv = block(x_BxTxD, tables, seg_BxT, plan, {**kv, **shared})
        layers.append(kv)
    x_BxTxD = self.final_norm(x_BxTxD)
    w_DxV = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
    logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(dt), preferred_element_type=jnp.float32)
    return logits_BxTxV, {"layers": layers, "seg": kv_seg_BxS, "start": start + tokens_BxT.shape[1]}


def _freq(cfg: ModelConfig):
  """model.rope_scaling's frequencies (computed on the host), or None for the plain ones."""
  freq = rope_scaling.inv_freq(cfg)
  return None if freq is None else jnp.asarray(freq)


def init_cache(cfg: ModelConfig, batch: int, length: int):
  """An empty KV cache of `length` slots per row for `Transformer.decode` (segment id 0 = empty)."""
  kv = lambda: {"k": jnp.zeros((batch, length, cfg.n_kv_heads, cfg.head_dim), cfg.dtype),  # noqa: E731
                "v": jnp.zeros((batch, length, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)}
  layers = ([kv() for _ in range(cfg.n_layers)] if not cfg.scan_layers
            else jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.n_layers, *a.shape)), kv()))
  return {"layers": layers, "seg": jnp.zeros((batch, length), jnp.int32), "start": jnp.zeros((), jnp.int32)}


def stack_blocks(blocks: list[Block]) -> Block:
  """One Block whose every parameter has a leading `layers` axis (model.scan_layers);
  layer i of the stack holds exactly `blocks[i]`'s parameters."""
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

  def body(x, layer_state):
    x, stats = run_block(nnx.merge(graphdef, layer_state), x, tables, seg_BxL)
    return x, stats

  x_BxLxD, stats = jax.lax.scan(body, x_BxLxD, state)
  n = jax.tree.leaves(state)[0].shape[0]
  return x_BxLxD, ([] if stats is None else [jax.tree.map(lambda a, i=i: a[i], stats) for i in range(n)])


def abstract(cfg: ModelConfig, seed: int = 0):
  """(graphdef, abstract nnx.State) without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))


def param_count(abstract_state) -> int:
  return sum(x.size for x in jax.tree.leaves(abstract_state))
