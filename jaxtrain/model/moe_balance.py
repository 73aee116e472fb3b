"""MoE balance: the auxiliary loss (jaxtrain's or Hugging Face's convention), the load
imbalance metric, and the aux-loss-free routing bias update.

Conventions, with f_e the share of a layer's T*k assignments that chose e and P_e the
mean router probability of e (`moe.route`):
  jaxtrain  aux = aux_weight * mean over MoE layers of X * sum_e f_e P_e
  hf        aux = aux_weight * k * X * sum_e f̄_e P̄_e, f̄ and P̄ pooled over all MoE layers
            (transformers' load_balancing_loss_func on the concatenated router logits:
            its per-expert token fractions sum to k, ours to 1), so a recipe's
            router_aux_loss_coef is used unchanged as moe_aux_weight.
Both add z_weight * mean over MoE layers of the router z-loss.

Aux-loss-free balancing (DeepSeek-V3): each MoE layer's router has a bias per expert,
added to the scores for the top-k selection only (the weights stay the scores). After
every applied update (`step.train_step`, after `guarded_update`), bias_e += rate *
sign(mean load - load_e), with load_e the assignments expert e received in the update
(all microbatches, before capacity drops).
The bias is a parameter of the model (`.../mlp/router_bias`, so it is in the train state
and checkpointed with the params) that gets no gradient: Adam's update of a zero
gradient is exactly zero, and it is not weight-decayed.
"""

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
  return {"aux": jnp.float32(0), "dropped": jnp.float32(0), "assigned": jnp.float32(0),
          "load": jnp.zeros((len(moe_layers(m)), max(m.moe_experts, 1)), jnp.float32)}


def totals(m: ModelConfig, stats: list[dict]) -> dict:
  """One microbatch's MoE totals (same structure as `zero_totals`)."""
  out = zero_totals(m)
  out["aux"] = aux_loss(m, stats)
  for k in ("dropped", "assigned"):
    out[k] = sum((s[k] for s in stats), jnp.float32(0))
  if stats:
    out["load"] = jnp.stack([s["load"] for s in stats])
  return out


def imbalance(load_LxX):
  """Mean over MoE layers of max_e load_e / mean_e load_e (1 = perfectly balanced)."""
  per_layer = jnp.max(load_LxX, axis=-1) / jnp.maximum(jnp.mean(load_LxX, axis=-1), 1e-9)
  return jnp.mean(per_layer)


def nudge(m: ModelConfig, params: dict, load_LxX, applied) -> dict:
  """params with every MoE layer's router_bias moved toward balance when the update was
  `applied` (a skipped step moves nothing); a no-op when off."""
  if m.moe_bias_rate <= 0 or not m.moe_experts:
    return params
  rate = jnp.where(applied, jnp.float32(m.moe_bias_rate), jnp.float32(0))
  delta_LxX = rate * jnp.sign(jnp.mean(load_LxX, axis=-1, keepdims=True) - load_LxX)
  layers = params["layers"]
  if m.scan_layers:  # one stacked block, every layer MoE
    mlp = layers["mlp"]
    return {**params, "layers": {**layers, "mlp": {**mlp, "router_bias": mlp["router_bias"] + delta_LxX}}}
  new = dict(layers)
  for j, i in enumerate(moe_layers(m)):
    mlp = layers[i]["mlp"]
    new[i] = {**layers[i], "mlp": {**mlp, "router_bias": mlp["router_bias"] + delta_LxX[j]}}
  return {**params, "layers": new}


def update_metrics(moe: dict, microbatches: int) -> dict:
  """The update's MoE metrics from its summed per-microbatch totals (the step and the pipeline)."""
  return {"moe_aux_loss": moe["aux"] / microbatches,
          "moe_dropped_frac": moe["dropped"] / jnp.maximum(moe["assigned"], 1.0),
          "moe_load_imbalance": imbalance(moe["load"]), "moe_load": moe["load"]}
