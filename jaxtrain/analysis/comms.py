"""Analytic communication per device per step, by mesh axis, from the shardings and shapes.

Ring collectives; formulas in README ("Communication"). XLA's schedule may differ.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.parallel import data_region, devices, expert_layout as moe_layout
from jaxtrain.analysis.memory import Row
from jaxtrain.model import quant
from jaxtrain.parallel import sharding

GRAD_BYTES = 4
BATCH_LIKE = ("data", "fsdp", "expert", "sequence")


def _wire_bytes(r: Row, s: int) -> float:
  """Bytes an element of parameter row `r` takes on the wire when gathered for the matmuls: the compute dtype's
  `s`, or QLoRA's codes and scales (plan.dequantize gathers those, not the dequantized weight)."""
  if r.role.quant == "none":
    return s
  return quant.nbytes(r.shape, r.role.quant, r.role.in_axis, r.role.lead) / math.prod(r.shape)


def _axes_of(spec) -> set[str]:
  return {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))}


def traffic(cfg, mesh, rows: list[Row]) -> dict[str, dict[str, int]]:
  """{mesh axis: {collective: bytes per device per step}} for every axis of size > 1."""
  m, k = cfg.model, cfg.train.microbatches
  s = np.dtype(m.dtype).itemsize
  T = sharding.tokens_per_device(cfg, mesh)
  platform = devices.of(mesh.devices.flat[0]).platform  # the target's, as the plan decides it
  out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for axis in BATCH_LIKE:
    n = mesh.shape[axis]
    if n == 1:
      continue
    g = 1 if axis == "data" and cfg.optim.zero_stage != 2 else k  # once per update over data (data_region)
    for r in rows:
      e = math.prod(r.device_shape) * r.count
      # LoRA's frozen base has no gradient: nothing to reduce (0 bytes a gradient element)
      gb = 0 if r.role.frozen else (
          data_region.wire_dtype(m, r.role, platform).itemsize if axis == "data" and g == 1 else GRAD_BYTES)
      if axis == "expert" and "experts" in r.axes:
        continue  # expert parallelism: each device keeps and updates its own experts
      if axis in _axes_of(r.spec):
        out[axis]["param all-gather (fwd+bwd)"] += int(2 * k * (n - 1) * e * _wire_bytes(r, s))
        out[axis]["grad reduce-scatter"] += g * (n - 1) * e * gb
      elif axis == "data" and cfg.optim.zero_stage:  # master split over data: the compute copy is gathered once
        cast = r.role.cast_at_use
        out[axis]["param all-gather (compute copy, once)"] += int((n - 1) / n * e * (s if cast else 4))
        if cfg.optim.zero_stage == 2:
          out[axis]["grad reduce-scatter"] += int(g * (n - 1) / n * e * gb)
        else:
          out[axis]["grad all-reduce"] += int(g * 2 * (n - 1) / n * e * gb)
      else:
        out[axis]["grad all-reduce"] += int(g * 2 * (n - 1) / n * e * gb)

  if mesh.shape["tensor"] > 1:
    out["tensor"].update(_tensor_traffic(cfg, mesh, rows, T, s))

  n = mesh.shape["sequence"]
  if n > 1:
    form = sequence_forms(cfg, mesh)
    if m.sequence_attention == "ulysses":  # the kernel masks whole sequences: their int32 segment ids, once
      out["sequence"]["ulysses all-to-all q/k/v/out (fwd+bwd)"] += int(k * held(cfg, mesh, m.n_layers)
                                                                       * form["ulysses"])
      out["sequence"]["segment ids all-gather"] += k * T * 4 * (n - 1)
    else:
      out["sequence"]["ring K/V transfers (fwd+bwd)"] += int(k * held(cfg, mesh, m.n_layers) * form["ring"])

  for axis, items in moe_traffic(cfg, mesh).items():
    out[axis].update(items)
  if mesh.shape.get("pipeline", 1) > 1:
    from jaxtrain.parallel import pipeline
    out["pipeline"].update(pipeline.traffic(cfg, mesh, rows))
  return {axis: dict(items) for axis, items in out.items()}


def _tensor_traffic(cfg, mesh, rows: list[Row], T: int, s: int) -> dict[str, int]:
  """What `tensor` moves per device per step: the layers' activation all-reduces (this stage's layers), the
  vocabulary-split embedding and head's, and the gradients of weights kept whole over `tensor`."""
  m, k, t = cfg.model, cfg.train.microbatches, mesh.shape["tensor"]
  ring, out = 2 * (t - 1) / t, collections.Counter()
  if max(sharding.axis_ways("act_heads", m.n_heads, mesh), sharding.axis_ways("act_mlp", m.d_ff, mesh)) > 1:
    out["activation all-reduce (4 per layer)"] += int(k * ring * 4 * held(cfg, mesh, m.n_layers) * T * m.d_model * s)
  if sharding.axis_ways("vocab", m.vocab_size, mesh) > 1:
    out["embedding + LM head all-reduce"] += int(k * ring * T * m.d_model * (4 + s))
  for r in rows:
    if len(r.shape) >= 2 and "tensor" not in _axes_of(r.spec) and r.role.kind != "embedding" and not r.role.frozen:
      out["grad all-reduce (weights replicated over tensor)"] += int(
          k * ring * math.prod(r.device_shape) * r.count * GRAD_BYTES)
  return dict(out)


def held(cfg, mesh, layers: int) -> float:
  """Of `layers` layers, those one device runs: all, or under a pipeline its stage's share (each stage runs only
  its own layers' activation collectives, every microbatch)."""
  return layers / mesh.shape.get("pipeline", 1)


def sequence_forms(cfg, mesh) -> dict:
  """Bytes per device that one layer's attention moves over `sequence` (one microbatch, forward and backward) in
  either form: ring, K/V to one neighbour n-1 times (and dK/dV back); ulysses, all-to-alls of q, k, v (KV heads
  repeated to the degree where fewer) and the output, (n-1)/n of each. ulysses: the error where heads cannot split."""
  from jaxtrain.parallel import ulysses
  m, n = cfg.model, mesh.shape["sequence"]
  T = sharding.tokens_per_device(cfg, mesh)
  K = m.n_kv_heads // sharding.axis_ways("act_kv_heads", m.n_kv_heads, mesh)
  out = {"ring": 3 * (n - 1) * T * 2 * K * m.head_dim * np.dtype(m.dtype).itemsize}
  try:
    out["ulysses"] = ulysses.traffic_per_layer(cfg, mesh, sharding.rules_for(cfg.run.sequence_parallel))
  except UserError as e:
    out["ulysses"] = str(e)
  return out


def moe_traffic(cfg, mesh) -> dict[str, dict[str, int]]:
  """{mesh axis: {what: bytes per device per step}} that the MoE dispatch moves, following
  the dispatch that runs (capacity buffers or the dropless exchange); {} for a dense model."""
  m, k = cfg.model, cfg.train.microbatches
  if not m.moe_layers():
    return {}
  layers = held(cfg, mesh, m.moe_layers())
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
