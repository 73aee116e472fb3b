"""The analytic memory bill per device, computed from the real shardings without allocating.

State (params, Adam m and v, counters) comes from `step.Setup`'s shardings: per-device
bytes = product of the per-device shape x itemsize. Gradients are float32 and sharded like
their params. Activations follow the formula in `activations` (what autodiff keeps for the
backward pass of this model). Temporaries and communication buffers are a stated margin.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import devices, sharding
from jaxtrain.errors import UserError

GiB = 2**30

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--device-memory") -> int:
  """'80GiB', '80GB', '85899345920' -> bytes."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS:
    raise UserError(f"{flag} {text!r} is not a size; use e.g. 80GiB, 80GB or a number of bytes")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory(text: str | None, device_kind: str) -> tuple[int | None, str]:
  """(bytes, where it came from) for --device-memory SIZE|KIND, else the local device's kind."""
  def by_kind(kind):
    entry = devices.lookup(kind)
    return entry.memory_bytes if entry else None
  if text:
    if text.strip()[:1].isdigit():
      return parse_size(text), text
    if by_kind(text) is None:
      raise UserError(f"--device-memory {text!r} is neither a size (e.g. 80GiB) nor a known device kind: "
                      f"{', '.join(devices.TABLE)}")
    return by_kind(text), text
  found = by_kind(device_kind)
  return found, device_kind if found else "unknown"


def per_device_shape(shape, spec, mesh) -> tuple[int, ...]:
  """Global shape divided, dimension by dimension, by the mesh axes that split it."""
  return tuple(NamedSharding(mesh, P(*spec)).shard_shape(tuple(shape)))


def _path(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class Row:
  """One parameter (or one group of identical repeated ones, `count` > 1)."""
  path: str
  axes: tuple
  spec: tuple
  shape: tuple[int, ...]
  device_shape: tuple[int, ...]
  dtype: str
  bytes: int  # per device, one instance
  count: int = 1


def param_rows(setup) -> list[Row]:
  """Every parameter with its logical axes, PartitionSpec and per-device shape and bytes."""
  from flax import nnx
  rows = []
  shardings = setup.state_shardings["params"]
  for path, var in jax.tree_util.tree_leaves_with_path(setup.abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    keys = [getattr(k, "key", k) for k in path]
    sh = shardings
    for k in keys:
      sh = sh[k]
    spec = tuple(sh.spec) + (None,) * (len(var.shape) - len(sh.spec))
    dshape = per_device_shape(var.shape, spec, setup.mesh)
    dtype = np.dtype(var.dtype)
    rows.append(Row("/".join(map(str, keys)), tuple(var.get_metadata()["axes"]), spec, tuple(var.shape), dshape,
                    dtype.name, math.prod(dshape) * dtype.itemsize))
  return rows


_LAYER = re.compile(r"(^|/)layers/\d+(/|$)")


def generic_path(text: str) -> str:
  """'layers/3/attn/wq' -> 'layers/*/attn/wq': the one pattern for a repeated layer's path."""
  return _LAYER.sub(r"\1layers/*\2", text)


def grouped(rows: list[Row]) -> list[Row]:
  """Repeated layers (layers/0/..., layers/1/...) shown once with a count where identical."""
  groups: dict[tuple, list[Row]] = {}
  for r in rows:
    key = generic_path(r.path)
    groups.setdefault((key, r.axes, r.spec, r.shape, r.dtype), []).append(r)
  return [dataclasses.replace(g[0], path=k[0] if len(g) > 1 else g[0].path, count=len(g)) for k, g in groups.items()]


def state_bytes(setup) -> dict[str, int]:
  """Per-device bytes of the real train state by part: params, adam_m, adam_v, counters."""
  abstract = jax.eval_shape(setup.init)
  out = {"params": 0, "adam_m": 0, "adam_v": 0, "counters": 0}
  leaves = jax.tree_util.tree_leaves_with_path(abstract)
  shards = jax.tree.leaves(setup.state_shardings)
  assert len(leaves) == len(shards)
  for (path, sds), sh in zip(leaves, shards, strict=True):
    p = _path(path)
    spec = tuple(sh.spec) + (None,) * (len(sds.shape) - len(sh.spec))
    n = math.prod(per_device_shape(sds.shape, spec, setup.mesh)) * np.dtype(sds.dtype).itemsize
    part = ("params" if p.startswith("params/") else "adam_m" if "/mu/" in f"/{p}/" else
            "adam_v" if "/nu/" in f"/{p}/" else "counters")
    out[part] += n
  return out


def _ways(name: str, dim: int, mesh) -> int:
  """How many ways the rules table splits a dimension of this logical axis on `mesh`."""
  entry = sharding.spec_for((name,), (dim,), mesh)[0]
  names = entry if isinstance(entry, tuple) else ((entry,) if entry else ())
  return math.prod(mesh.shape[a] for a in names)


def tokens_per_device(cfg, mesh) -> int:
  """Tokens of one microbatch on one device: rows over the batch axes, length over sequence."""
  t = cfg.train
  rows = t.batch_size // t.microbatches // _ways("batch", t.batch_size // t.microbatches, mesh)
  return rows * (t.seq_len // _ways("length", t.seq_len, mesh))


def activations(cfg, mesh, remat: str = "none") -> dict[str, int]:
  """Activation bytes per device kept for the backward pass of one microbatch.

  remat "none" (the default of model.remat): everything autodiff saves, per token per
  layer, with s = bytes of the compute dtype and sizes per device (heads H, KV heads K and
  MLP width F divided by their tensor split, D by its act_embed split, L the full length):
    2 RMSNorms      2 (8 + s) D + 16   f32 input, f32 normalized, s output, f32 statistics
    q, k, v, o      s (2H + 2K) E
    attention       H (L (1 + 2c + s) + 2c)  bool mask, masked scores, exp, s probabilities,
                                       softmax row statistics (c = bytes of
                                       model.attention_logits_dtype: 4 for float32)
    SwiGLU          6 s F              gate, up, three silu residuals, their product
  plus, once, the RoPE tables (sin and cos, f32, E/2 each: 4 E), the final norm and the
  f32 exp of the logits: 4 E + (8 + s) D + 4 V.
  remat "full" (one checkpoint per block): the block inputs s D per token per layer, plus
  one layer's "none" set recomputed during the backward pass.
  """
  m = cfg.model
  s = np.dtype(m.dtype).itemsize
  D = m.d_model // _ways("act_embed", m.d_model, mesh)
  H = m.n_heads // _ways("act_heads", m.n_heads, mesh)
  K = m.n_kv_heads // _ways("act_kv_heads", m.n_kv_heads, mesh)
  F = m.d_ff // _ways("act_mlp", m.d_ff, mesh)
  V = m.vocab_size // _ways("act_vocab", m.vocab_size, mesh)
  E, L = m.head_dim, cfg.train.seq_len
  c = np.dtype(m.attention_logits_dtype).itemsize
  T = tokens_per_device(cfg, mesh)
  per_layer = {
      "norms": 2 * (8 + s) * D + 16, "qkvo": s * (2 * H + 2 * K) * E,
      "attention_matrix": H * (L * (1 + 2 * c + s) + 2 * c), "swiglu": 6 * s * F,
  }
  head = T * (4 * E + (8 + s) * D + 4 * V)
  if remat == "none":
    out = {k: m.n_layers * T * v for k, v in per_layer.items()}
  elif remat == "full":
    out = {"block_inputs": m.n_layers * T * s * D, "one_layer_recomputed": T * sum(per_layer.values())}
  else:
    raise ValueError(remat)
  out["final_norm_and_logits"] = head
  return out


def weight_copies(cfg, rows: list[Row], mesh) -> int:
  """Compute-dtype copies of the matmul weights that the backward pass reuses (no remat):
  each weight gathered over the batch-like axes it is stored on (FSDP), split by the rest."""
  s = np.dtype(cfg.model.dtype).itemsize
  total = 0
  for r in rows:
    if len(r.shape) < 2 or (r.path == "embed" and not cfg.model.tie_embeddings):
      continue  # norm scales are not cast; the untied embedding is a lookup
    gathered = math.prod(mesh.shape[a] for e in r.spec if e
                         for a in (e if isinstance(e, tuple) else (e,)) if a in sharding.RULES["batch"])
    total += math.prod(r.device_shape) * gathered * s * r.count
  return total


@dataclasses.dataclass
class Bill:
  items: dict[str, int]          # name -> bytes per device, margin included
  notes: dict[str, str]          # name -> how it is counted
  total: int
  full_remat_activations: int


def bill(setup, rows: list[Row], margin: float) -> Bill:
  cfg, mesh = setup.cfg, setup.mesh
  st = state_bytes(setup)
  t = cfg.train
  batch = 5 * 4 * (t.batch_size // _ways("batch", t.batch_size, mesh)) * (t.seq_len // _ways("length", t.seq_len, mesh))
  # model.remat none/full are counted exactly; the partial policies save a subset of
  # "none", so "none" is their upper bound.
  remat = cfg.model.remat if cfg.model.remat in ("none", "full") else "none"
  act = activations(cfg, mesh, remat)
  items = {
      "params": st["params"],
      "gradients": st["params"],
      "grad_accumulator": st["params"] if t.microbatches > 1 else 0,
      "adam_m": st["adam_m"],
      "adam_v": st["adam_v"],
      "counters": st["counters"],
      "batch": batch,
      "weight_copies": weight_copies(cfg, rows, mesh),
      "activations": sum(act.values()),
  }
  notes = {
      "params": "float32; they are the master copy (no separate one)",
      "gradients": "float32, sharded like the params",
      "grad_accumulator": f"float32 sum over {t.microbatches} microbatches" if t.microbatches > 1 else "none (1 microbatch)",
      "adam_m": "float32, sharded like the params",
      "adam_v": "float32, sharded like the params",
      "counters": "step, Adam count, loss scale",
      "batch": "inputs, targets, positions, segment ids, loss mask (int32)",
      "weight_copies": f"{cfg.model.dtype} matmul weights gathered over fsdp, kept for backward",
      "activations": f"remat {remat}"
                     + (f" (upper bound for {cfg.model.remat})" if remat != cfg.model.remat else "")
                     + ", one microbatch: " + ", ".join(f"{k} {human(v)}" for k, v in act.items()),
  }
  items["margin"] = int(margin * sum(items.values()))
  notes["margin"] = f"temporaries and communication buffers: {margin:.0%} of the items above"
  full = sum(activations(cfg, mesh, "full").values())
  return Bill(items, notes, sum(items.values()), full)


def verdict(b: Bill, capacity: int | None) -> str:
  if capacity is None:
    return "no device memory known: give --device-memory (e.g. 80GiB or H100) for a verdict"
  big = sorted(((v, k) for k, v in b.items.items() if v), reverse=True)[:3]
  largest = ", ".join(f"{k} {human(v)}" for v, k in big)
  if b.total <= capacity:
    return f"fits: {human(b.total)} of {human(capacity)} ({human(capacity - b.total)} free)"
  return f"does not fit: misses by {human(b.total - capacity)} ({human(b.total)} of {human(capacity)}); largest: {largest}"


def human(n) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"
