"""The update rule: AdamW (optax) on the global-norm-clipped gradient, its learning-rate schedule by applied updates,
weight decay by parameter role, and the all-or-nothing guarded update (docs/training.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.core.config import Config, OptimConfig
from jaxtrain.model import moe_balance, roles


def lr_schedule(o: OptimConfig, steps: int) -> optax.Schedule:
  """By optimizer updates applied: linear warmup (lr/warmup, 2*lr/warmup, .., lr at update warmup-1),
  then cosine from lr at update `warmup` to lr*min_lr_ratio at update `steps`, held there after."""
  cosine = optax.cosine_decay_schedule(o.lr, max(steps - o.warmup_steps, 1), alpha=o.min_lr_ratio)
  if o.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(o.lr / o.warmup_steps, o.lr, o.warmup_steps - 1)  # 0 steps: constant lr
  return optax.join_schedules([warmup, cosine], [o.warmup_steps])


def parts(cfg: Config) -> tuple[float, optax.GradientTransformation]:
  """(the global-norm clip, 0: none; AdamW with decay where the role table says): `optimizer` chains them."""
  o = cfg.optim
  adamw = optax.adamw(lr_schedule(o, cfg.train.steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                      mask=lambda params: roles.mask(cfg.model, params, "decayed"))
  return o.grad_clip, adamw


def optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW on the global-norm-clipped gradient (no clip when optim.grad_clip is 0). The state is AdamW's
  alone, the checkpoint layout the same either way (`optax.chain` would nest it one level down)."""
  max_norm, adamw = parts(cfg)
  if max_norm <= 0:
    return adamw
  clip = optax.clip_by_global_norm(max_norm)

  def update(g, state, params=None):
    g, _ = clip.update(g, clip.init(g))
    return adamw.update(g, state, params)
  return optax.GradientTransformation(adamw.init, update)


def all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def guarded_update(opt: optax.GradientTransformation, params, opt_state, g, ok, bias_delta=None):
  """(params, opt_state, applied): the update of `opt` when `ok` and the new params are finite, else the old values;
  one `lax.cond` between the two states, not an elementwise select per array. `bias_delta`
  (`moe_balance.bias_delta`): the routing biases move with an applied update only."""
  updates, new_opt = opt.update(g, opt_state, params)
  new_params = moe_balance.add(optax.apply_updates(params, updates), bias_delta)
  finite = all_finite(new_params)  # e.g. a huge lr: finite gradients, overflowing params
  return jax.lax.cond(ok & finite, lambda: (new_params, new_opt, True), lambda: (params, opt_state, False))

