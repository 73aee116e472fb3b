"""A Llama-shaped decoder-only transformer in Flax NNX, plain math: parameters carry logical axes (`axes`
metadata), activations are annotated with logical names through `ops`, and how anything runs on devices is the
installed `ops`' business (jaxtrain.model.ops). B batch, L length, D d_model, V vocab, T fed tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import mla as mla_lib, ops, quant
from jaxtrain.model.block import RESIDUAL, Block, empty_cache
from jaxtrain.model.layers import norm, param, rope_tables
from jaxtrain.model.mtp import MTP

NAMED = ("q", "k", "v", "attn_out", "mlp_hidden")


def remat_policy(name: str):
  """model.remat -> (use jax.checkpoint, its policy). `none` saves everything autodiff wants."""
  cp = jax.checkpoint_policies
  return {
      "none": (False, None),  # (with QLoRA's base: every matmul's output, `_remat`)
      "full": (True, cp.nothing_saveable),
      "save_dots": (True, cp.dots_with_no_batch_dims_saveable),  # projections, not the L x L scores
      "save_named": (True, cp.save_only_these_names(*NAMED)),
      "offload_named": (True, cp.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=list(NAMED),
          offload_src="device", offload_dst="pinned_host")),
  }[name]


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)
    blocks = [Block(cfg, rngs, cfg.is_moe_layer(i)) for i in range(cfg.n_layers)]
    if cfg.scan_layers:  # `layers`, after a `dense_layers` stack of the dense first layers (cfg.stacks)
      for name, idx in cfg.stacks().items():
        setattr(self, name, stack_blocks(blocks[idx.start:idx.stop]))
    else:
      self.layers = nnx.List(blocks)
    self.final_norm = norm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
    if cfg.mtp_layers:
      self.mtp = MTP(cfg, rngs)

  def __call__(self, tokens_BxL, pos_BxL, seg_BxL):
    """float32 logits (B, L, V)."""
    h_BxLxD, _ = self.hidden(tokens_BxL, pos_BxL, seg_BxL)
    return ops.constrain(self.logits(h_BxLxD), ("batch", "length", "act_vocab"))

  def head_weight(self):
    """The output projection (D, V), float32: the embedding's transpose when tied."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def logits(self, h_BxLxD):
    return jnp.einsum("bld,dv->blv", h_BxLxD, ops.cast(self.head_weight(), ("embed", "vocab"), h_BxLxD.dtype),
                      preferred_element_type=jnp.float32)

  def embed_tokens(self, tokens_BxL):
    """The token embeddings in the compute dtype, annotated as the residual stream."""
    # Looked up from the fsdp-sharded table as stored: rows come out split over fsdp on D and XLA moves them to the
    # batch split (on CPU it warns of a full rematerialization there). Gathering the table first silences that
    # but moves the whole float32 table and its gradient every step (2 x 2 GiB at 8B), far more than the rows.
    x_BxLxD = ops.lookup(self.embed[...], tokens_BxL).astype(jnp.dtype(self.cfg.dtype))
    return ops.constrain(scale_embeddings(x_BxLxD, self.cfg), RESIDUAL)

  def hidden(self, tokens_BxL, pos_BxL, seg_BxL):
    """(final-normed hidden states (B, L, D), list of MoE layers' stats): the forward pass without the head."""
    x_BxLxD = self.embed_tokens(tokens_BxL)
    tables = rope_tables(pos_BxL, self.cfg)
    moe_stats = []
    windows = self.cfg.layer_windows()
    if self.cfg.scan_layers:
      for name, idx in self.cfg.stacks().items():
        x_BxLxD, stats = run_stack(getattr(self, name), x_BxLxD, tables, seg_BxL, self.cfg.remat, self.cfg.dtype,
                                   windows[idx.start:idx.stop])
        moe_stats += stats
    else:
      run_block = _remat(self.cfg.remat, prevent_cse=True, dtype=self.cfg.dtype)
      for block, window in zip(self.layers, windows):
        x_BxLxD, stats = run_block(block, x_BxLxD, tables, seg_BxL, window)
        moe_stats += [] if stats is None else [stats]
    return self.final_norm(x_BxLxD), moe_stats

  def max_logits(self, tokens_BxL, pos_BxL, seg_BxL):
    """(n_layers, H) float32: each layer's largest attention logit per head on this batch, in layer order (the
    pass of optim.qk_clip: the layers' forward again, without gradient, the MTP module not)."""
    x_BxLxD, tables, out = self.embed_tokens(tokens_BxL), rope_tables(pos_BxL, self.cfg), []
    if not self.cfg.scan_layers:
      for block in self.layers:
        x_BxLxD, m_H = block.probe(x_BxLxD, tables, seg_BxL)
        out.append(m_H)
      return jnp.stack(out)
    for name in self.cfg.stacks():
      graphdef, state = nnx.split(getattr(self, name))
      body = lambda x, layer, g=graphdef: nnx.merge(g, layer).probe(x, tables, seg_BxL)  # noqa: E731
      x_BxLxD, m_NxH = jax.lax.scan(body, x_BxLxD, state)
      out.append(m_NxH)
    return jnp.concatenate(out)

  def mtp_hidden(self, h_BxLxD, targets_BxL, tables, seg_BxL, next_emb_BxLxD=None):
    """The multi-token-prediction module on the final hidden states: (its head-normed hidden, MoE stats or None).
    `next_emb_BxLxD`: the targets' embeddings where the caller looked them up (the pipeline, outside its region)."""
    next_emb_BxLxD = self.embed_tokens(targets_BxL) if next_emb_BxLxD is None else next_emb_BxLxD
    return self.mtp(h_BxLxD, next_emb_BxLxD, tables, seg_BxL)

  def block(self, i: int) -> Block:
    """Layer i (a slice of its scanned stack)."""
    if not self.cfg.scan_layers:
      return self.layers[i]
    name, idx = next((n, r) for n, r in self.cfg.stacks().items() if i in r)
    graphdef, state = nnx.split(getattr(self, name))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i - idx.start], state))

  def decode(self, tokens_BxT, pos_BxT, seg_BxT, cache):
    """KV-cached forward of T new tokens into cache slots [start, start+T): (float32 logits (B, T, V), cache)."""
    x_BxTxD = self.embed_tokens(tokens_BxT)
    tables = rope_tables(pos_BxT, self.cfg)
    start = cache["start"]
    kv_seg_BxS = jax.lax.dynamic_update_slice(cache["seg"], seg_BxT.astype(cache["seg"].dtype), (0, start))
    shared = {"seg": kv_seg_BxS, "start": start}
    new, windows = {}, self.cfg.layer_windows()
    if stacked_cache(self.cfg):
      for name, idx in self.cfg.stacks().items():
        graphdef, state = nnx.split(getattr(self, name))
        window = windows[idx.start]  # one window for every layer of a stacked cache

        def body(x, layer, graphdef=graphdef, window=window):
          x, _, kv = dense(nnx.merge(graphdef, layer[0]), self.cfg.dtype)(x, tables, seg_BxT, {**layer[1], **shared},
                                                                          window=window)
          return x, kv
        x_BxTxD, new[name] = jax.lax.scan(body, x_BxTxD, (state, cache[name]))
    else:  # one layer at a time (a scanned stack of mixed windows: each layer its slice, its own cache size)
      new["layers"] = []
      for i, (kv, window) in enumerate(zip(cache["layers"], windows)):
        x_BxTxD, _, kv = dense(self.block(i), self.cfg.dtype)(x_BxTxD, tables, seg_BxT, {**kv, **shared},
                                                               window=window)
        new["layers"].append(kv)
    logits_BxTxV = self.logits(self.final_norm(x_BxTxD))
    return logits_BxTxV, {**new, "seg": kv_seg_BxS, "start": start + tokens_BxT.shape[1]}


def scale_embeddings(x_BxLxD, cfg: ModelConfig):
  """model.embed_scale: looked-up rows times sqrt(d_model), that factor first rounded to the rows' dtype (as
  transformers' Gemma does)."""
  return x_BxLxD * jnp.asarray(cfg.d_model ** 0.5, x_BxLxD.dtype) if cfg.embed_scale else x_BxLxD


def stacked_cache(cfg: ModelConfig) -> bool:
  """Whether decoding scans a stack over one stacked cache: scanned layers all of one window (a stack of mixed
  windows decodes layer by layer, each local layer's cache the size of its window)."""
  return cfg.scan_layers and len(cfg.window_choices()) == 1


def init_cache(cfg: ModelConfig, batch: int, length: int):
  """An empty KV cache of `length` slots per row for `Transformer.decode` (segment id 0 = empty); a local layer's
  holds its window's slots only."""
  windows = cfg.layer_windows()
  kv = (lambda w: mla_lib.empty_cache(cfg, batch, length)) if cfg.attention_type == "mla" else (
      lambda w: empty_cache(cfg, batch, length, w))
  stacks = {"layers": [kv(w) for w in windows]} if not stacked_cache(cfg) else {
      name: jax.tree.map(lambda a, n=len(idx): jnp.broadcast_to(a, (n, *a.shape)), kv(windows[idx.start]))
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


def dense(block: Block, dtype) -> Block:
  """`block` with QLoRA's quantized weights (quant.QTensor values) dequantized to `dtype`; the block itself when it
  has none. Called where one layer runs, so one layer's dense weights live at a time."""
  if not _quantized(block):
    return block
  graphdef, state = nnx.split(block)

  def one(var):
    q = var.get_value()
    if not quant.is_quantized(q):
      return var
    # the weight's logical axes: a stacked block's metadata leads with `layers`, which a scan slice no longer has
    return var.replace(ops.dequantize(q, var.get_metadata()["axes"][-(q.lead + len(q.shape)):], dtype))
  return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _remat(remat: str, prevent_cse: bool, dtype=jnp.bfloat16):
  """block(x, tables, seg) under model.remat's policy, QLoRA's weights dequantized inside it (`dense`). No policy
  saves them (none is a matmul's output or a name); `none` would (a value computed from undifferentiated inputs is
  kept for backward: every layer's dense weights at once), so under QLoRA it saves every matmul's output instead and
  recomputes the elementwise work, the dequantization among it."""
  use_remat, policy = remat_policy(remat)
  run = lambda block, x_BxLxD, tables, seg_BxL, window: dense(block, dtype)(  # noqa: E731
      x_BxLxD, tables, seg_BxL, window=window)
  if use_remat:
    return nnx.remat(run, policy=policy, prevent_cse=prevent_cse)
  dots = jax.checkpoint_policies.checkpoint_dots
  return lambda block, *args: (nnx.remat(run, policy=dots, prevent_cse=prevent_cse)(block, *args)
                               if _quantized(block) else run(block, *args))


def _quantized(block) -> bool:
  return any(map(quant.is_quantized, jax.tree.leaves(nnx.state(block), is_leaf=quant.is_quantized)))


def run_stack(stacked: Block, x_BxLxD, tables, seg_BxL, remat: str = "none", dtype=jnp.bfloat16,
              windows: tuple[int, ...] | None = None):
  """A stack of blocks (`stack_blocks`; or any slice of one) as one jax.lax.scan over its leading axis, each block
  under the remat policy (QLoRA: dequantized there, `dense`): (x, list of each MoE layer's stats). `windows`: each
  layer's attention window (cfg.layer_windows; None: all global), scanned beside its parameters."""
  state = nnx.split(stacked)[1]
  n = jax.tree.leaves(state)[0].shape[0]
  windows_N = jnp.asarray(windows or (0,) * n, jnp.int32)
  layer = layer_fn(stacked, tables, seg_BxL, remat, dtype)
  x_BxLxD, stats = jax.lax.scan(lambda x, lw: layer(x, *lw), x_BxLxD, (state, windows_N))
  return x_BxLxD, ([] if stats is None else [jax.tree.map(lambda a, i=i: a[i], stats) for i in range(n)])


def layer_fn(stacked: Block, tables, seg_BxL, remat: str = "none", dtype=jnp.bfloat16):
  """One layer of a stack as f(x, layer, window=0) -> (x, MoE stats or None), `layer` its parameters without the
  leading   `layers` axis (an nnx.State slice, or the pure dict's), under the remat policy: what `run_stack` scans, for the
  callers that scan the stack themselves (the update in the backward, jaxtrain.run.in_backward)."""
  graphdef = nnx.split(stacked)[0]
  run_block = _remat(remat, prevent_cse=False, dtype=dtype)  # the scan already keeps the recomputation apart
  return lambda x_BxLxD, layer, window=0: run_block(nnx.merge(graphdef, layer), x_BxLxD, tables, seg_BxL, window)


def abstract(cfg: ModelConfig, seed: int = 0):
  """(graphdef, abstract nnx.State) without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))


def param_count(abstract_state) -> int:
  return sum(x.size for x in jax.tree.leaves(abstract_state))
