"""MoE balance: the auxiliary loss (jaxtrain's or Hugging Face's convention), the load imbalance metric, and the
aux-loss-free routing bias (DeepSeek-V3; a parameter that gets no gradient). The MoE layers are the model's, then
the multi-token-prediction block's when it runs (model.mtp_weight > 0) and is an MoE layer: its statistics enter
the aux loss and its bias moves like the others."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import mtp


def moe_layers(m: ModelConfig) -> list[int]:
  return [i for i in range(m.n_layers) if m.is_moe_layer(i)]


def mtp_is_moe(m: ModelConfig) -> bool:
  """The MTP block runs in training and routes its tokens to experts."""
  return mtp.trains(m) and m.is_moe_layer(m.n_layers)


def layer_count(m: ModelConfig) -> int:
  """MoE layers whose statistics an update has: the model's and the MTP block's."""
  return len(moe_layers(m)) + mtp_is_moe(m)


def aux_loss(m: ModelConfig, stats: list[dict]):
  """The auxiliary loss of one microbatch from its MoE layers' stats (0 for a dense model)."""
  if not stats:
    return jnp.float32(0)
  return layer_aux(m, stats, len(stats))


def layer_aux(m: ModelConfig, stats: list[dict], n_layers: int):
  """jaxtrain's convention: the sum of these layers' aux losses / n_layers (a share of the mean over every MoE
  layer, so that a pipeline chunk can add its layers'); Hugging Face's pools all layers (stats = all of them)."""
  z = sum(s["z"] for s in stats) / n_layers
  if m.moe_aux_convention == "hf":
    share = sum(s["share"] for s in stats) / n_layers
    prob = sum(s["prob"] for s in stats) / n_layers
    balance = m.moe_top_k * m.moe_experts * jnp.sum(share * prob)
  else:
    balance = sum(s["balance"] for s in stats) / n_layers
  return m.moe_aux_weight * balance + m.moe_z_weight * z


def zero_totals(m: ModelConfig) -> dict:
  """Per-microbatch MoE totals, zero: aux, dropped, assigned and load (MoE layers, X)."""
  return {"aux": jnp.float32(0), "dropped": jnp.float32(0), "assigned": jnp.float32(0),
          "load": jnp.zeros((layer_count(m), max(m.moe_experts, 1)), jnp.float32)}


def totals(m: ModelConfig, stats: list[dict]) -> dict:
  """One microbatch's MoE totals from its MoE layers' stats (every one of `layer_count`, in order)."""
  if not stats:
    return zero_totals(m)
  return {"aux": aux_loss(m, stats), **{k: sum(s[k] for s in stats) for k in ("dropped", "assigned")},
          "load": jnp.stack([s["load"] for s in stats])}


def update_metrics(moe: dict, microbatches: int) -> dict:
  """The update's MoE metrics from its summed totals; imbalance: mean over layers of max_e load / mean_e load."""
  load = moe["load"]
  imbalance = jnp.mean(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9))
  return {"moe_aux_loss": moe["aux"] / microbatches, "moe_dropped_frac": moe["dropped"] / jnp.maximum(moe["assigned"], 1.0),
          "moe_load_imbalance": imbalance, "moe_load": load}


def bias_delta(m: ModelConfig, load_LxX) -> dict | None:
  """The routing biases' move after an update, rate * sign(mean load - load_e) per layer, as a sparse tree shaped
  like the parameters (only the router_bias leaves); None when the rule is off."""
  if m.moe_bias_rate <= 0 or not m.moe_experts:
    return None
  delta_LxX = m.moe_bias_rate * jnp.sign(jnp.mean(load_LxX, axis=-1, keepdims=True) - load_LxX)
  bias = lambda d: {"mlp": {"router_bias": d}}  # noqa: E731
  n = len(moe_layers(m))
  if m.scan_layers:  # the `layers` stack holds every MoE layer (dense first layers: `dense_layers`)
    out = {"layers": bias(delta_LxX[:n])}
  else:
    out = {"layers": {i: bias(delta_LxX[j]) for j, i in enumerate(moe_layers(m))}}
  if mtp_is_moe(m):
    out["mtp"] = {"block": bias(delta_LxX[n])}
  return out


def add(params: dict, sparse: dict | None) -> dict:
  """`params` with `sparse` (a tree over a subset of its keys, e.g. `bias_delta`'s) added where it has leaves."""
  if sparse is None:
    return params
  if not isinstance(params, dict):
    return params + sparse.astype(params.dtype)
  return {k: add(v, sparse[k]) if k in sparse else v for k, v in params.items()}


def pick(sparse: dict | None, keys) -> dict | None:
  """The part of a sparse tree under the top-level `keys` (None where it has none)."""
  if sparse is None:
    return None
  part = {k: sparse[k] for k in keys if k in sparse}
  return part or None

