"""MuonClip's QK-clip (optim.qk_clip = tau > 0, docs/training.md#qk-clip): after an applied update, each attention
head whose largest logit q.k / sqrt(E) in the step exceeded tau has its logits scaled down by gamma = tau / max
through its query and key weights (Kimi K2's rule). A key head of its own (K = H) shares gamma: W_q and W_k each
by sqrt(gamma). Grouped-query keys serve several heads: as Kimi K2 treats MLA's shared rotary key, the key stays
and each query head takes its whole gamma. Either way a head's logits scale by exactly its gamma.

The largest logits come from a pass of their own (`max_logits`): the layers' forward again on the step's
parameters and batch, without gradient, under the execution plan (so any attention kernel, any mesh), one
microbatch at a time. Its cost is about one forward of the layers (a third of a step's matmuls, less with remat)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.core.config import Config
from jaxtrain.run import grads as grads_lib


def max_logits(objective, params, batch):
  """(n_layers, H) float32: each layer's largest attention logit per head over the whole batch."""
  mbs = grads_lib.split_microbatches(batch, objective.cfg.train.microbatches)
  model = objective.model(params)
  one = lambda mb: model.max_logits(mb["inputs"], mb["positions"], mb["segment_ids"])  # noqa: E731
  return jnp.max(jax.lax.map(one, mbs), axis=0)


def factors(cfg: Config, max_LxH):
  """(W_q's factor (n_layers, H), W_k's (n_layers, K)): 1 for a head within tau."""
  m, tau = cfg.model, cfg.optim.qk_clip
  gamma_LxH = jnp.where(max_LxH > tau, tau / jnp.maximum(max_LxH, tau), 1.0)
  if m.n_kv_heads == m.n_heads:
    return jnp.sqrt(gamma_LxH), jnp.sqrt(gamma_LxH)
  return gamma_LxH, jnp.ones((max_LxH.shape[0], m.n_kv_heads), jnp.float32)


def clip(cfg: Config, params, max_LxH, applied):
  """`params` (float32, the updated ones) with the heads over tau rescaled where the update `applied`."""
  q_LxH, k_LxK = (jnp.where(applied, f, 1.0) for f in factors(cfg, max_LxH))

  def attn(a, rows):  # one layer's attention ((D, H, E) weights), or a stack's ((n, D, H, E))
    q, k = q_LxH[rows], k_LxK[rows]
    lead = (slice(None),) if isinstance(rows, slice) else ()
    return {**a, "wq": a["wq"] * q[(*lead, None, slice(None), None)].astype(a["wq"].dtype),
            "wk": a["wk"] * k[(*lead, None, slice(None), None)].astype(a["wk"].dtype)}

  out = dict(params)
  if cfg.model.scan_layers:
    for name, idx in cfg.model.stacks().items():
      out[name] = {**params[name], "attn": attn(params[name]["attn"], slice(idx.start, idx.stop))}
  else:
    out["layers"] = {i: {**layer, "attn": attn(layer["attn"], i)} for i, layer in params["layers"].items()}
  return out


def metrics(cfg: Config, max_LxH) -> dict:
  """The step's largest logit per layer (n_layers,) and how many heads exceeded tau."""
  return {"attn_max_logit": jnp.max(max_LxH, axis=1),
          "qk_clipped_heads": jnp.sum(max_LxH > cfg.optim.qk_clip).astype(jnp.int32)}
