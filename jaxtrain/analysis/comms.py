"""Analytic communication per device per step, by mesh axis, from the shardings and shapes.

Ring collectives over n devices, for an array of S bytes in total: all-gather and
reduce-scatter move (n-1)/n S per device, all-reduce 2 (n-1)/n S. With k microbatches,
s = compute-dtype bytes, g = 4 (float32 gradients), T = tokens per device per microbatch,
and e = a parameter's elements per device:
  fsdp/data/expert/sequence, a param split over the axis (FSDP): all-gather of the
      compute-dtype weight in the forward and again in the backward, 2 k (n-1) e s, and
      reduce-scatter of its gradient, k (n-1) e g;
  the same axes, a param replicated over the axis: gradient all-reduce, k 2 (n-1)/n e g
      (the tokens are split over these axes, so every gradient is a partial sum);
  tensor (Megatron): per layer two all-reduces of T D s in the forward (after wo and
      w_down) and two in the backward (into the q/k/v and gate/up inputs); the vocab-split
      embedding lookup one of T D 4 (float32 table) and the LM head one of T D s; each
      k 2 (t-1)/t x that. A matmul weight replicated over tensor (duplicated KV heads)
      also all-reduces its gradient there;
  sequence (ring attention): per layer each device passes its K and V blocks, T 2 K E s,
      to n-1 neighbours in the forward and again with dK and dV in the backward: 3 k (n-1) x that;
  expert: expert weights split over `expert` are neither gathered nor reduced there (each
      device computes and updates only its own experts); per MoE layer, the dispatch and
      the combine all-to-all in the forward and their transposes in the backward, each
      moving (n-1)/n of the buffer of the dispatch that runs (`moe_traffic`), in the
      compute dtype: capacity buffers X x groups x C x D (groups of G tokens, C their
      capacity), or the dropless exchange's ep x bound x D (plus its int32 expert ids
      once, forward only): 4 k (n-1)/n x rows x D s per MoE layer;
  sequence, MoE layers whose dispatch holds whole sequences: the layer's input and output
      resharded from length-split to row-split and back, forward and backward, 4 (n-1)/n T D s.
The actual schedule is XLA's: it may fuse, reorder or keep gathered weights instead of
gathering twice; these are the bytes the shardings imply.
"""

from __future__ import annotations

import math

import numpy as np

from jaxtrain.parallel import expert_layout as moe_layout
from jaxtrain.analysis.memory import Row
from jaxtrain.parallel import sharding

GRAD_BYTES = 4
BATCH_LIKE = ("data", "fsdp", "expert", "sequence")


def _axes_of(spec) -> set[str]:
  return {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))}


def traffic(cfg, mesh, rows: list[Row]) -> dict[str, dict[str, int]]:
  """{mesh axis: {collective: bytes per device per step}} for every axis of size > 1."""
  m, k = cfg.model, cfg.train.microbatches
  s = np.dtype(m.dtype).itemsize
  T = sharding.tokens_per_device(cfg, mesh)
  out: dict[str, dict[str, int]] = {}

  def add(axis, what, nbytes):
    out.setdefault(axis, {}).setdefault(what, 0)
    out[axis][what] += int(nbytes)

  for axis in BATCH_LIKE:
    n = mesh.shape[axis]
    if n == 1:
      continue
    for r in rows:
      e = math.prod(r.device_shape) * r.count
      if axis == "expert" and "experts" in r.axes:
        continue  # expert parallelism: each device keeps and updates its own experts
      if axis in _axes_of(r.spec):
        add(axis, "param all-gather (fwd+bwd)", 2 * k * (n - 1) * e * s)
        add(axis, "grad reduce-scatter", k * (n - 1) * e * GRAD_BYTES)
      else:
        add(axis, "grad all-reduce", k * 2 * (n - 1) / n * e * GRAD_BYTES)

  t = mesh.shape["tensor"]
  if t > 1:
    ring = 2 * (t - 1) / t
    split = sharding.axis_ways("act_heads", m.n_heads, mesh) > 1 or sharding.axis_ways("act_mlp", m.d_ff, mesh) > 1
    if split:
      add("tensor", "activation all-reduce (4 per layer)", k * ring * 4 * m.n_layers * T * m.d_model * s)
    if sharding.axis_ways("vocab", m.vocab_size, mesh) > 1:
      add("tensor", "embedding + LM head all-reduce", k * ring * T * m.d_model * (4 + s))
    for r in rows:
      if len(r.shape) >= 2 and "tensor" not in _axes_of(r.spec) and r.path != "embed":
        add("tensor", "grad all-reduce (weights replicated over tensor)",
            k * ring * math.prod(r.device_shape) * r.count * GRAD_BYTES)

  n = mesh.shape["sequence"]
  if n > 1:
    K = m.n_kv_heads // sharding.axis_ways("act_kv_heads", m.n_kv_heads, mesh)
    add("sequence", "ring K/V transfers (fwd+bwd)", 3 * k * (n - 1) * m.n_layers * T * 2 * K * m.head_dim * s)

  for axis, items in moe_traffic(cfg, mesh).items():
    for what, nbytes in items.items():
      add(axis, what, nbytes)
  if mesh.shape.get("pipeline", 1) > 1:
    from jaxtrain.parallel import pipeline
    for what, nbytes in pipeline.traffic(cfg, mesh, rows).items():
      add("pipeline", what, nbytes)
  return out


def moe_traffic(cfg, mesh) -> dict[str, dict[str, int]]:
  """{mesh axis: {what: bytes per device per step}} that the MoE dispatch moves, following
  the dispatch that runs (capacity buffers or the dropless exchange); {} for a dense model."""
  m, k = cfg.model, cfg.train.microbatches
  layers = m.moe_layers()
  if not layers:
    return {}
  s = np.dtype(m.dtype).itemsize
  out: dict[str, dict[str, int]] = {}
  ep = mesh.shape["expert"]
  buf = moe_layout.buffer_rows(cfg, mesh)
  if ep > 1:
    ring = (ep - 1) / ep
    what = f"MoE all-to-all, {buf['kind']} (4 per MoE layer, {buf['rows']} rows)"
    out["expert"] = {what: int(k * layers * 4 * ring * buf["rows"] * m.d_model * s)}
    if m.moe_dropless:
      out["expert"]["MoE dropless expert ids"] = int(k * layers * ring * buf["rows"] * 4)
  n, t = mesh.shape["sequence"], cfg.train
  if n > 1 and "sequence" in str(moe_layout.token_spec(mesh, t.batch_size // t.microbatches, t.seq_len)[0]):
    out["sequence"] = {"MoE reshard to whole sequences (fwd+bwd)":
                       int(k * layers * 4 * (n - 1) / n * buf["tokens"] * m.d_model * s)}
  return out
