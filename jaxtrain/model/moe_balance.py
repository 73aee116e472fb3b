"""MoE balance: the auxiliary loss (jaxtrain's or Hugging Face's convention), the load imbalance metric, and
the aux-loss-free routing bias update (DeepSeek-V3; the bias is a parameter that gets no gradient)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.core.config import ModelConfig


def moe_layers(m: ModelConfig) -> list[int]:
  return [i for i in range(m.n_layers) if m.is_moe_layer(i)]


def aux_loss(m: ModelConfig, stats: list[dict]):
  """The auxiliary loss of one microbatch from its MoE layers' stats (0 for a dense model)."""
  if not stats:
    return jnp.float32(0)
  z = sum(s["z"] for s in stats) / len(stats)
  if m.moe_aux_convention == "hf":
    share = sum(s["share"] for s in stats) / len(stats)
    prob = sum(s["prob"] for s in stats) / len(stats)
    balance = m.moe_top_k * m.moe_experts * jnp.sum(share * prob)
  else:
    balance = sum(s["balance"] for s in stats) / len(stats)
  return m.moe_aux_weight * balance + m.moe_z_weight * z


def zero_totals(m: ModelConfig) -> dict:
  """Per-microbatch MoE totals, zero: aux, dropped, assigned and load (MoE layers, X)."""
  return totals(m, [])


def totals(m: ModelConfig, stats: list[dict]) -> dict:
  """One microbatch's MoE totals from its MoE layers' stats."""
  load = (jnp.stack([s["load"] for s in stats]) if stats
          else jnp.zeros((len(moe_layers(m)), max(m.moe_experts, 1)), jnp.float32))
  return {"aux": aux_loss(m, stats), **{k: sum((s[k] for s in stats), jnp.float32(0)) for k in ("dropped", "assigned")},
          "load": load}


def nudge(m: ModelConfig, params: dict, load_LxX, applied) -> dict:
  """params with each router_bias moved by rate * sign(mean load - load_e) if `applied`; a no-op when off."""
  if m.moe_bias_rate <= 0 or not m.moe_experts:
    return params
  rate = jnp.where(applied, jnp.float32(m.moe_bias_rate), jnp.float32(0))
  delta_LxX = rate * jnp.sign(jnp.mean(load_LxX, axis=-1, keepdims=True) - load_LxX)
  layers = params["layers"]
  if m.scan_layers:  # the `layers` stack holds every MoE layer (dense first layers: `dense_layers`)
    mlp = layers["mlp"]
    return {**params, "layers": {**layers, "mlp": {**mlp, "router_bias": mlp["router_bias"] + delta_LxX}}}
  new = dict(layers)
  for j, i in enumerate(moe_layers(m)):
    mlp = layers[i]["mlp"]
    new[i] = {**layers[i], "mlp": {**mlp, "router_bias": mlp["router_bias"] + delta_LxX[j]}}
  return {**params, "layers": new}


def update_metrics(moe: dict, microbatches: int) -> dict:
  """The update's MoE metrics from its summed totals; imbalance: mean over layers of max_e load / mean_e load."""
  load = moe["load"]
  imbalance = jnp.mean(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9))
  return {"moe_aux_loss": moe["aux"] / microbatches, "moe_dropped_frac": moe["dropped"] / jnp.maximum(moe["assigned"], 1.0),
          "moe_load_imbalance": imbalance, "moe_load": load}
