"""The update rule: AdamW (optax), or Muon on the projection matrices (run/muon.py), on the global-norm-clipped
gradient, its learning-rate schedule by applied updates, weight decay by parameter role, and the all-or-nothing
guarded update (docs/training.md)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxtrain.core.config import Config, OptimConfig
from jaxtrain.model import moe_balance, roles
from jaxtrain.run import moments, muon as muon_lib


def lr_schedule(o: OptimConfig, steps: int) -> optax.Schedule:
  """By optimizer updates applied: linear warmup (lr/warmup, 2*lr/warmup, .., lr at update warmup-1),
  then cosine from lr at update `warmup` to lr*min_lr_ratio at update `steps`, held there after."""
  cosine = optax.cosine_decay_schedule(o.lr, max(steps - o.warmup_steps, 1), alpha=o.min_lr_ratio)
  if o.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(o.lr / o.warmup_steps, o.lr, o.warmup_steps - 1)  # 0 steps: constant lr
  return optax.join_schedules([warmup, cosine], [o.warmup_steps])


TOKEN_UNIT = 2 ** 30  # the tokens counter is (units of 2^30, rest): int32 alone would overflow at 2.1e9 tokens


def in_tokens(cfg: Config) -> bool:
  """The schedule's position is the valid tokens of applied updates (train.tokens), held in state["tokens"]."""
  return cfg.train.tokens > 0


def lr_in_step(cfg: Config) -> bool:
  """Whether the step computes its learning rate itself (tokens, or scaled by the batch) instead of optax's count."""
  return in_tokens(cfg) or cfg.optim.lr_reference_batch > 0


def batch_factor(o: OptimConfig, rows: int) -> float:
  """optim.lr_reference_batch's rule of thumb: lr x (rows / reference), or its square root; 1 when off."""
  if not o.lr_reference_batch:
    return 1.0
  r = rows / o.lr_reference_batch
  return r if o.lr_batch_scaling == "linear" else math.sqrt(r)


def token_schedule(o: OptimConfig, total: int):
  """By T, the valid tokens of applied updates including this update's: linear warmup lr * T / warmup_tokens, then
  cosine from lr at warmup_tokens to lr * min_lr_ratio at `total` (train.tokens), held there after."""
  def at(t):
    t = jnp.asarray(t, jnp.float32)
    frac = jnp.clip((t - o.warmup_tokens) / max(total - o.warmup_tokens, 1), 0.0, 1.0)
    cosine = o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return cosine if not o.warmup_tokens else jnp.where(t < o.warmup_tokens, o.lr * t / o.warmup_tokens, cosine)
  return at


def tokens_value(counter) -> jax.Array:
  """state["tokens"] (int32 [units of 2^30, rest]) as float32."""
  return counter[0].astype(jnp.float32) * TOKEN_UNIT + counter[1].astype(jnp.float32)


def tokens_add(counter, n) -> jax.Array:
  """state["tokens"] + n (n < 2^30 per update), carried into the units."""
  rest = counter[1] + jnp.asarray(n, jnp.int32)
  return jnp.stack([counter[0] + rest // TOKEN_UNIT, rest % TOKEN_UNIT])


def learning_rate(cfg: Config, state, n_valid, rows: int) -> jax.Array:
  """The learning rate of this update (`lr_in_step`): the schedule in tokens at the applied tokens before it plus
  its own valid ones, or in steps at the applied updates, times `batch_factor` of its global batch `rows`."""
  o = cfg.optim
  if in_tokens(cfg):
    base = token_schedule(o, cfg.train.tokens)(tokens_value(state["tokens"]) + jnp.asarray(n_valid, jnp.float32))
  else:
    base = lr_schedule(o, cfg.train.steps)(state["step"])
  return base * batch_factor(o, rows)


def parts(cfg: Config, shardings=None, lr=None) -> tuple[float, optax.GradientTransformation]:
  """(the global-norm clip, 0: none; the update rule of optim.name): AdamW with decay where the role table says, or
  Muon (`muon.scale_by_muon`) on the role table's Muon matrices and that AdamW on the rest. `optimizer` chains them.
  `shardings`: the momentum's, a tree like the trained params (Muon gathers each matrix whole from them). `lr`: this
  update's learning rate (`learning_rate`) instead of the schedule by optax's count (the state's layout the same)."""
  o = cfg.optim
  schedule = lr_schedule(o, cfg.train.steps) if lr is None else (lambda _: lr)
  decayed = lambda params: roles.mask(cfg.model, params, "decayed")  # noqa: E731
  if o.state_dtype == "float32":
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decayed)
  else:  # optax.adamw's chain, its moments kept as optim.state_dtype says
    adamw = optax.chain(moments.scale_by_adam(o.b1, o.b2, o.eps, o.state_dtype),
                        optax.add_decayed_weights(o.weight_decay, decayed), optax.scale_by_learning_rate(schedule))
  if o.name == "adamw":
    return o.grad_clip, adamw
  # NS in the compute dtype, bfloat16 for float16 (a normalized matrix's entries fall below half's normal range)
  dtype = jnp.float32 if cfg.model.dtype == "float32" else jnp.bfloat16
  muon = optax.chain(muon_lib.scale_by_muon(o.muon_momentum, o.eps, cfg.model, shardings, dtype, o.state_dtype),
                     optax.add_decayed_weights(o.weight_decay), optax.scale_by_learning_rate(schedule))
  def label(params):
    return jax.tree.map(lambda m: "muon" if m else "adamw", roles.mask(cfg.model, params, "muon"))
  return o.grad_clip, optax.partition({"adamw": adamw, "muon": muon}, label)


def optimizer(cfg: Config, shardings=None, lr=None) -> optax.GradientTransformation:
  """The update rule (`parts`) on the global-norm-clipped gradient (no clip when optim.grad_clip is 0). The state is
  the rule's alone, the checkpoint layout the same either way (`optax.chain` would nest it one level down)."""
  max_norm, adamw = parts(cfg, shardings, lr)
  if max_norm <= 0:
    return adamw

  def update(g, state, params=None):
    return adamw.update(clip(g, optax.tree.norm(g), max_norm), state, params)
  return optax.GradientTransformation(adamw.init, update)


def clip(g, norm, max_norm: float):
  """`g` (a whole gradient, or any part of one) scaled to the global norm `max_norm` where its whole gradient's
  `norm` exceeds it, as optax.clip_by_global_norm; the update in the backward (jaxtrain.run.in_backward) knows
  `norm` before it sees a layer's gradient."""
  if max_norm <= 0:
    return g
  return jax.tree.map(lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm), g)


def all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


LIMIT = 2.0 ** 126  # below float32's overflow (2^128), with room for the update's roundings


def adam_ratio_bound(o: OptimConfig, t) -> jax.Array | None:
  """`moments.ratio_bound` of optim's betas: the most an AdamW update can move a parameter (times lr) at update t."""
  return moments.ratio_bound(o.b1, o.b2, t)


def stays_finite(cfg: Config, count, params, bias_delta=None, lr=None) -> jax.Array | None:
  """Whether the update at 0-based update `count` provably leaves every parameter finite (a scalar), from
  scalars and one max |p|: |p'| <= max|p| + lr (U_t + wd max|p|) + max|bias delta| < LIMIT, U_t AdamW's bound or,
  larger, a Muon matrix's (`muon.NS_ENTRY_BOUND` times its update scale). It is known before the
  update runs, so the update is one pass over p, g, m, v (the guard fuses into it) instead of a second pass that
  picks new or old values after checking the new parameters. None where there is no such bound (`adam_ratio_bound`).
  Finite gradients are the caller's part of the guard (the gradient norm). Moments kept below float32
  (optim.state_dtype) keep the bound: their update is clipped to it (`moments.scale_by_adam`)."""
  o = cfg.optim
  ratio = adam_ratio_bound(o, count + 1)
  if ratio is None:
    return None
  if o.name == "muon":  # a Muon matrix moves by at most its update scale times NS_ENTRY_BOUND (times lr)
    ratio = jnp.maximum(ratio, max([muon_lib.update_scale(r, x.shape) * muon_lib.NS_ENTRY_BOUND for r, x in zip(
        jax.tree.leaves(roles.tree(cfg.model, params)), jax.tree.leaves(params)) if r.muon], default=0.0))
  absmax = lambda tree: jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32)  # noqa: E731
                                           for x in jax.tree.leaves(tree)] or [jnp.float32(0)]))
  p = absmax(params)
  lr = lr_schedule(o, cfg.train.steps)(count) if lr is None else lr
  d = absmax(bias_delta) if bias_delta is not None else 0.0
  return p + lr * (ratio + o.weight_decay * p) + d < LIMIT


def guarded_update(opt: optax.GradientTransformation, params, opt_state, g, ok, bias_delta=None, safe=None):
  """(params, opt_state, applied): the update of `opt` when `ok` and the new params are finite, else the old values.
  `safe` (`stays_finite`): the new params are known finite beforehand, and each array picks new or old in the
  update's own pass; None: the new params are checked after the update, then one `lax.cond` between the two
  states (a second pass over p, m, v). `bias_delta` (`moe_balance.bias_delta`): the routing biases move with an
  applied update only."""
  updates, new_opt = opt.update(g, opt_state, params)
  new_params = moe_balance.add(optax.apply_updates(params, updates), bias_delta)
  if safe is not None:
    apply = ok & safe
    pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
    return pick(new_params, params), pick(new_opt, opt_state), apply
  finite = all_finite(new_params)  # e.g. a huge lr: finite gradients, overflowing params
  return jax.lax.cond(ok & finite, lambda: (new_params, new_opt, True), lambda: (params, opt_state, False))
