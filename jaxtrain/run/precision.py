"""Dynamic loss scaling: a small jit-friendly state next to the optimizer (float16 gradients
scaled into range; a non-finite step is skipped and the scale backs off)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.core.config import Config


def enabled(cfg: Config) -> bool:
  mode = cfg.loss_scale.mode
  return mode == "dynamic" or (mode == "auto" and cfg.model.dtype == "float16")


def init(cfg: Config) -> dict:
  scale = cfg.loss_scale.initial if enabled(cfg) else 1.0
  return {"scale": jnp.float32(scale), "good_steps": jnp.int32(0)}


def update(cfg: Config, state: dict, finite) -> dict:
  """Next scale after a step whose gradients were (or were not) all finite."""
  if not enabled(cfg):
    return state
  ls = cfg.loss_scale
  good = jnp.where(finite, state["good_steps"] + 1, 0)
  grow = good >= ls.growth_interval
  grown = jnp.where(grow, jnp.minimum(state["scale"] * ls.growth_factor, ls.max), state["scale"])
  scale = jnp.where(finite, grown, jnp.maximum(state["scale"] * ls.backoff_factor, ls.min))
  return {"scale": scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good).astype(jnp.int32)}
