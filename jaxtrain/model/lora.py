"""LoRA (model.lora_rank): low-rank adapters beside the projections model.lora_targets names, and the merged
weights W + A B * alpha / r that a plain export writes. Which parameters train is the role table's (roles.frozen)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.core.config import ModelConfig

SUFFIX = "_lora"  # the adapter of weight `wq` is the module `wq_lora` beside it
# model.lora_targets' names (config.LORA_TARGETS) -> the weight each adapts
WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


class LoRA(nnx.Module):
  """A low-rank adapter beside one projection weight W (its first `n_in` dimensions the input's): delta = x A B *
  alpha / r (PEFT's convention), A uniform in +-1/sqrt(fan in) (PEFT's kaiming bound), B zero, so training starts
  from the base model. A and B take W's input and output logical axes: the rules table shards them like W; the
  rank is replicated."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, w: nnx.Param, n_in: int):
    r, axes = cfg.lora_rank, w.get_metadata()["axes"]
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    bound = 1 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(rngs.params(), (*in_shape, r), jnp.float32, -bound, bound)
    self.lora_a = nnx.Param(a, axes=(*axes[:n_in], None))
    self.lora_b = nnx.Param(jnp.zeros((r, *out_shape), jnp.float32), axes=(None, *axes[n_in:]))
    self.n_in, self.mult = n_in, cfg.lora_alpha / r

  def __call__(self, x):
    dt = x.dtype
    h = jnp.tensordot(x, self.lora_a[...].astype(dt), self.n_in)
    return jnp.tensordot(h, self.lora_b[...].astype(dt), 1) * jnp.asarray(self.mult, dt)


def add_adapters(module: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, n_in: dict[str, int]) -> None:
  """A `<weight>_lora` adapter beside each of `module`'s weights that model.lora_targets names; `n_in`: each
  weight attribute -> its input dimensions."""
  for name in cfg.lora_target_names():
    if (attr := WEIGHTS[name]) in n_in:
      setattr(module, attr + SUFFIX, LoRA(cfg, rngs, getattr(module, attr), n_in[attr]))


def adapted(module: nnx.Module, attr: str, x, y):
  """`y` (x through `module`'s weight `attr`) plus that weight's adapter's delta, where it has one."""
  lora = getattr(module, attr + SUFFIX, None)
  return y if lora is None else y + lora(x).astype(y.dtype)


def without_adapters(params: dict) -> dict:
  """`params` (a pure dict) with every adapter's B zero: the model computes the base alone (DPO's reference under
  LoRA, without a second copy of the base)."""
  def walk(node, under_adapter=False):
    if not isinstance(node, dict):
      return node
    return {k: jnp.zeros_like(v) if under_adapter and k == "lora_b" else walk(v, under_adapter or
                                                                                 str(k).endswith(SUFFIX))
            for k, v in node.items()}
  return walk(params)


def delta(a, b, mult: float, stacked: bool):
  """A B * alpha / r in the weight's own shape, float32 (`stacked`: both with a leading layers axis)."""
  one = lambda a, b: jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), 1) * mult  # noqa: E731
  return jax.vmap(one)(a, b) if stacked else one(a, b)


def merged(cfg: ModelConfig, params: dict, stacked) -> dict:
  """`params` (a pure dict) with every adapter folded into its weight, W + A B * alpha / r in float32, and the
  adapters gone: the base model's tree. `stacked(path)`: whether the weight at `path` has a layers axis."""
  def walk(node, path):
    if not isinstance(node, dict):
      return node
    out = {k: walk(v, (*path, k)) for k, v in node.items() if not str(k).endswith(SUFFIX)}
    for k, v in node.items():
      if str(k).endswith(SUFFIX):
        w = k[:-len(SUFFIX)]
        out[w] = node[w].astype(jnp.float32) + delta(v["lora_a"], v["lora_b"], cfg.lora_alpha / cfg.lora_rank,
                                                     stacked((*path, w)))
    return out
  return walk(params, ())
