"""LoRA (model.lora_rank): low-rank adapters beside the projections model.lora_targets names, and the merged
weights W + A B * alpha / r that a plain export writes. Which parameters train is the role table's (roles.frozen).
A stacked weight (MoE's experts (X, in, out)) gets one adapter per slice: A (X, in, r), B (X, r, out)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import ops, wgrad

SUFFIX = "_lora"  # the adapter of weight `wq` is the module `wq_lora` beside it
# model.lora_targets' names (config.LORA_TARGETS) -> the weight each adapts
WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down",
           "q_a": "wq_a", "q_b": "wq_b", "kv_a": "wkv_a", "kv_b": "wkv_b"}  # the last four: MLA's


class LoRA(nnx.Module):
  """A low-rank adapter beside one projection weight W (after `n_batch` leading axes that each hold their own
  weight, e.g. MoE's experts, its next `n_in` dimensions the input's): delta = x A B * alpha / r (PEFT's
  convention), A uniform in +-1/sqrt(fan in) (PEFT's kaiming bound), B zero, so training starts from the base
  model. A and B take W's batch, input and output logical axes: the rules table shards them like W; the rank is
  replicated."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, w: nnx.Param, n_in: int, n_batch: int = 0):
    r, axes, nb = cfg.lora_rank, w.get_metadata()["axes"], n_batch
    lead, in_shape, out_shape = w.shape[:nb], w.shape[nb:nb + n_in], w.shape[nb + n_in:]
    bound = 1 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(rngs.params(), (*lead, *in_shape, r), jnp.float32, -bound, bound)
    self.lora_a = nnx.Param(a, axes=(*axes[:nb + n_in], None))
    self.lora_b = nnx.Param(jnp.zeros((*lead, r, *out_shape), jnp.float32), axes=(*axes[:nb], None, *axes[nb + n_in:]))
    self.n_in, self.n_batch, self.mult = n_in, n_batch, cfg.lora_alpha / r

  def __call__(self, x):
    dt = x.dtype
    h = jnp.tensordot(x, self.lora_a[...].astype(dt), self.n_in)
    return jnp.tensordot(h, self.lora_b[...].astype(dt), 1) * jnp.asarray(self.mult, dt)

  def delta(self, dt):
    """A B * alpha / r in W's shape, in `dt`."""
    return product(self.lora_a[...].astype(dt), self.lora_b[...].astype(dt), self.n_batch) * jnp.asarray(self.mult, dt)


def product(a, b, batch: int):
  """A B contracted over the rank, separately for each index of the `batch` leading axes both share."""
  one = lambda a, b: jnp.tensordot(a, b, 1)  # noqa: E731
  for _ in range(batch):
    one = jax.vmap(one)
  return one(a, b)


def add_adapters(module: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, n_in: dict[str, int], n_batch: int = 0):
  """A `<weight>_lora` adapter beside each of `module`'s weights that model.lora_targets names; `n_in`: each
  weight attribute -> its input dimensions (after `n_batch` leading axes, one adapter each)."""
  for name in cfg.lora_target_names():
    if (attr := WEIGHTS[name]) in n_in and hasattr(module, attr):
      setattr(module, attr + SUFFIX, LoRA(cfg, rngs, getattr(module, attr), n_in[attr], n_batch))


def adapted(module: nnx.Module, attr: str, x, y):
  """`y` (x through `module`'s weight `attr`) plus that weight's adapter's delta, where it has one (and, where the
  weight's gradient is deferred, handing its (x, dy) to the pipeline's W: wgrad.tap)."""
  y = wgrad.tap(getattr(module, attr), x, y)
  lora = getattr(module, attr + SUFFIX, None)
  return y if lora is None else y + lora(x).astype(y.dtype)


def effective(module: nnx.Module, attr: str, dt):
  """`module`'s weight `attr` in `dt`, its adapter merged in (W + A B * alpha / r) where it has one: for products
  that use the weight itself (MoE's expert dispatch, MLA's absorbed decoding); gradients reach A and B through it."""
  w = ops.weight(getattr(module, attr), dt)
  lora = getattr(module, attr + SUFFIX, None)
  return w if lora is None else w + lora.delta(dt)


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


def delta(a, b, mult: float, batch: int):
  """A B * alpha / r in the weight's own shape, float32 (`batch`: the leading axes both have, layers or experts)."""
  return product(a.astype(jnp.float32), b.astype(jnp.float32), batch) * mult


def merged(cfg: ModelConfig, params: dict) -> dict:
  """`params` (a pure dict) with every adapter folded into its weight, W + A B * alpha / r in float32, and the
  adapters gone: the base model's tree. A weight's leading axes beyond the adapter's in and out (a layers stack,
  experts) are read from the shapes: A (*lead, *in, r) and B (*lead, r, *out) of W (*lead, *in, *out)."""
  def walk(node):
    if not isinstance(node, dict):
      return node
    out = {k: walk(v) for k, v in node.items() if not str(k).endswith(SUFFIX)}
    for k, v in node.items():
      if str(k).endswith(SUFFIX):
        w, a, b = node[k[:-len(SUFFIX)]], v["lora_a"], v["lora_b"]
        batch = a.ndim + b.ndim - 2 - len(w.shape)
        out[k[:-len(SUFFIX)]] = w.astype(jnp.float32) + delta(a, b, cfg.lora_alpha / cfg.lora_rank, batch)
    return out
  return walk(params)
