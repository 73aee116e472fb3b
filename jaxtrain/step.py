"""The train step, readable top to bottom, and the sharded setup around it.

Train state: {"params": pure dict of fp32 arrays, "opt": optax state, "step": int32}.
Loss contract: sum of per-token cross-entropy over valid tokens, divided by the number
of valid tokens in the WHOLE update (all microbatches, all data-parallel ranks). The
global view of jit makes "all ranks" automatic: the batch is one global array.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import model as model_lib
from jaxtrain import sharding
from jaxtrain.config import Config, TrainConfig
from jaxtrain.errors import UserError

BATCH_AXES = ("batch", "length")
# Weight decay applies to the projection matrices only: not to norm scales (they set a
# scale, not a direction) and not to the embedding table (rows of rare tokens would be
# pulled to zero between their rare updates).
DECAYED = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"})


def lr_schedule(t: TrainConfig):
  """Linear warmup (lr/warmup .. lr), then cosine to lr*min_lr_ratio at the last step.

  Its argument is the number of optimizer updates already applied.
  """
  def lr(count):
    s = jnp.asarray(count, jnp.float32)
    warm = t.lr * (s + 1) / max(t.warmup_steps, 1)
    progress = jnp.clip((s - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 0.0, 1.0)
    cosine = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(s < t.warmup_steps, warm, cosine)
  return lr


def decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in DECAYED, params)


def optimizer(t: TrainConfig) -> optax.GradientTransformation:
  return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask)


def token_loss_sum(graphdef, params, mb):
  """Sum (not mean) of next-token cross-entropy over the valid targets of a microbatch."""
  logits_BxLxV = nnx.merge(graphdef, params)(mb["inputs"], mb["positions"], mb["segment_ids"])
  target_logit_BxL = jnp.take_along_axis(logits_BxLxV, mb["targets"][..., None], axis=-1)[..., 0]
  nll_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_logit_BxL
  return jnp.sum(nll_BxL * mb["loss_mask"])


def split_microbatches(batch, k: int):
  """(B, L) -> (k, B/k, L), microbatch i = rows i, i+k, ... so no row changes device."""
  def split(x_BxL):
    B, L = x_BxL.shape
    x_kxbxL = x_BxL.reshape(B // k, k, L).swapaxes(0, 1)
    return sharding.constrain(x_kxbxL, (None, "batch", "length"))
  return jax.tree.map(split, batch)


def grads(graphdef, params, batch, microbatches: int):
  """Token-normalized loss and gradient of one update, accumulated over microbatches."""
  n_valid = jnp.sum(batch["loss_mask"])
  zeros = jax.tree.map(jnp.zeros_like, params)

  def accumulate(carry, mb):
    loss_sum, grad_sum = carry
    l, g = jax.value_and_grad(token_loss_sum, argnums=1)(graphdef, params, mb)
    return (loss_sum + l, jax.tree.map(jnp.add, grad_sum, g)), None

  (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros),
                                         split_microbatches(batch, microbatches))
  denom = jnp.maximum(n_valid, 1).astype(jnp.float32)  # normalized once, for the whole update
  return loss_sum / denom, jax.tree.map(lambda g: g / denom, grad_sum), n_valid


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def train_step(graphdef, opt: optax.GradientTransformation, t: TrainConfig, state, batch):
  loss, g, n_valid = grads(graphdef, state["params"], batch, t.microbatches)
  grad_norm = global_norm(g)  # before clipping, as logged
  if t.grad_clip > 0:
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, t.grad_clip / (grad_norm + 1e-6)), g)
  updates, opt_state = opt.update(g, state["opt"], state["params"])
  new_state = {"params": optax.apply_updates(state["params"], updates), "opt": opt_state, "step": state["step"] + 1}
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(t)(state["step"]), "tokens": n_valid}
  return new_state, metrics


class Setup:
  """The model, optimizer, shardings and jitted functions of one (config, mesh)."""

  def __init__(self, cfg: Config, mesh):
    self.cfg, self.mesh = cfg, mesh
    check_fits_mesh(cfg, mesh)
    self.graphdef, abstract_state = model_lib.abstract(cfg.model, cfg.train.seed)
    self.n_params = model_lib.param_count(abstract_state)
    self.notes: list[str] = []
    param_sh = sharding.param_shardings(abstract_state, mesh, self.notes)
    self.opt = optimizer(cfg.train)
    replicated = NamedSharding(mesh, P())
    abstract_params = nnx.to_pure_dict(abstract_state)
    opt_sh = optax.tree_map_params(self.opt, lambda _, sh: sh, jax.eval_shape(self.opt.init, abstract_params),
                                   param_sh, transform_non_params=lambda _: replicated)
    self.state_shardings = {"params": param_sh, "opt": opt_sh, "step": replicated}
    t = cfg.train
    self.batch_sharding = sharding.logical_sharding(mesh, BATCH_AXES, (t.batch_size, t.seq_len))

    def init():
      params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(t.seed))))
      return {"params": params, "opt": self.opt.init(params), "step": jnp.zeros((), jnp.int32)}

    def step(state, batch):
      with sharding.active_mesh(mesh):
        return train_step(self.graphdef, self.opt, t, state, batch)

    # Initializers run under jit with output shardings: each shard is created on its device.
    self.init = jax.jit(init, out_shardings=self.state_shardings)
    self.step = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                        out_shardings=(self.state_shardings, replicated), donate_argnums=0)

  def device_batch(self, local: dict):
    """This process's rows -> global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}


def check_fits_mesh(cfg: Config, mesh) -> None:
  """Mesh-dependent config checks, as user errors."""
  t = cfg.train
  batch_ways = math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  per_micro = t.batch_size // t.microbatches
  if per_micro % batch_ways:
    raise UserError(f"train.batch_size={t.batch_size} / train.microbatches={t.microbatches} = {per_micro} sequences "
                    f"per microbatch must divide over data*fsdp*expert={batch_ways} devices")
  if t.seq_len % mesh.shape["sequence"]:
    raise UserError(f"train.seq_len={t.seq_len} must divide over sequence={mesh.shape['sequence']} devices")
