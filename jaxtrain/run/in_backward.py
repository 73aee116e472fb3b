"""The optimizer step fused into the backward (optim.in_backward; docs/training.md#the-step): each
scanned layer's AdamW update is applied as soon as its gradient exists, inside the backward's own scan over the
layers, so the layers' whole gradient is never held (one layer's at a time; the embedding's, head's and norms'
gradients, outside the stacks, are held until the end).

The step runs the model's pieces itself: the embedding, each stack's scan and the head, each under `jax.vjp`; the
forward's residuals are those plain autodiff keeps (the remat policy's), minus the layer's own parameters, which the
backward reads from where they are updated. Two reverse scans follow:

1. the norm pass: each layer's gradient, reduced at once to its sum of squares: the global gradient norm exactly as
   the plain step logs and clips by, and whether the gradient is finite, before any parameter moves;
2. the update pass: each layer's gradient again, clipped by that norm, its update written in place into the
   carried master and moments (`where(apply, new, old)`, the plain step's guard: a non-finite gradient in any layer,
   a non-finite loss, no valid token, or an update that could overflow moves nothing anywhere).

The price of the all-or-nothing guarantee without holding the gradient is the second backward (about 2/3 of a
step's FLOPs more): a one-pass update could not take back the layers it updated before a later layer's non-finite
gradient shows. In exchange, global-norm clipping is the plain step's. One microbatch, no pipeline, AdamW, dense
scanned layers, no LoRA, ZeRO or offload (core.checks.check_in_backward, check_fits_mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.model import transformer as model_lib
from jaxtrain.model.layers import rope_tables
from jaxtrain.run import grads as grads_lib, optimizer as optim_lib

OUTER = "outer"  # the group of every parameter outside the layer stacks


def update(objective, state, batch, scale):
  """(mean token loss, unscaled gradient norm, n_valid, new params, new optimizer state, applied) of one step."""
  cfg = objective.cfg
  opt = optim_lib.parts(cfg)[1]  # the update rule alone: the global norm's clip is applied here, layer by layer
  params = state["params"]
  w, n_valid = grads_lib.weights(cfg, batch, scale)
  mb = jax.tree.map(lambda x: x[0], grads_lib.split_microbatches(grads_lib.with_mtp_targets(cfg, batch), 1))
  ce, backward = _forward(objective, params, mb, w, scale)
  # 1. the norm pass: the parameters read as they are (loop constants), only sums of squares carried
  sumsq = lambda g: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))  # noqa: E731 (as optax.tree.norm)
  g_outer, sums = backward(lambda s, i, g, c: c + sumsq(g), {s: jnp.float32(0) for s in cfg.model.stacks()},
                           lambda s, c: params[s])
  grad_norm = jnp.sqrt(sumsq(g_outer) + sum(sums.values()))
  loss = ce / jnp.maximum(n_valid, 1)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
  apply = finite & (n_valid > 0) & optim_lib.stays_finite(cfg, state["step"], params)
  # 2. the update pass
  new_params, new_opt = _update_pass(opt, cfg, params, state["opt"], backward, grad_norm, apply)
  return loss, grad_norm, n_valid, new_params, new_opt, apply


def _forward(objective, params, mb, w, scale):
  """The forward of one microbatch in pieces under `jax.vjp`: (its token loss sum, `backward`).
  backward(consume, carries, read) runs the whole backward once: `consume(stack, i, layer gradient, carry) ->
  carry` on each layer, last first, the layer's parameters read from `read(stack, carry)`; it returns (the outer
  parameters' gradient, the carries). Gradients unscaled."""
  cfg = objective.cfg
  names = list(cfg.model.stacks())
  outer = {k: v for k, v in params.items() if k not in names}
  model = objective.model(params)
  whole = lambda o: objective.model({**params, **o})  # noqa: E731 (the model with these outer parameters)
  x_BxLxD, embed_vjp = jax.vjp(lambda o: whole(o).embed_tokens(mb["inputs"]), outer)
  tables = rope_tables(mb["positions"], cfg.model)
  stacks = {}
  for s in names:
    layer = model_lib.layer_fn(getattr(model, s), tables, mb["segment_ids"], cfg.model.remat, cfg.model.dtype)
    x_BxLxD, stacks[s] = _stack_forward(layer, x_BxLxD, params[s])

  def tail(o, h_BxLxD):
    m = whole(o)
    out, ce, _ = objective.head(m, m.final_norm(h_BxLxD), mb, w)
    return out, ce
  out, tail_vjp, ce = jax.vjp(tail, outer, x_BxLxD, has_aux=True)
  unscale = lambda g: jax.tree.map(lambda x: x / jnp.asarray(scale, x.dtype), g)  # noqa: E731

  def backward(consume, carries, read):
    g_tail, dy_BxLxD = tail_vjp(jnp.ones_like(out))
    carries = dict(carries)
    for s in reversed(names):
      dy_BxLxD, carries[s] = _stack_backward(stacks[s], dy_BxLxD, carries[s],
                                             lambda i, g, c, s=s: consume(s, i, unscale(g), c),
                                             lambda c, s=s: read(s, c))
    g_outer = jax.tree.map(jnp.add, g_tail, embed_vjp(dy_BxLxD)[0])
    return unscale(g_outer), carries
  return ce, backward


def _update_pass(opt, cfg, params, opt_state, backward, grad_norm, apply):
  """(new params, new optimizer state): the backward again, each stack's master and moments carried and layer i's
  update written in place as its gradient exists; the outer parameters' update after it. Nothing moves unless
  `apply`."""
  names = list(cfg.model.stacks())
  pick = lambda new, old: jnp.where(apply, new, old)  # noqa: E731
  max_norm = cfg.optim.grad_clip
  labels = {k: jax.tree.map(lambda _, k=k: k if k in names else OUTER, v) for k, v in params.items()}
  state_labels = optax.tree_map_params(opt, lambda _, lab: lab, opt_state, labels, transform_non_params=lambda _: "")
  only = lambda group, g: {k: (g[k] if k == group or (group == OUTER and k not in names)  # noqa: E731
                               else jax.tree.map(_empty, v)) for k, v in params.items()}

  def step_layer(s, i, g, carry):
    p_s, o_s = carry
    p_old, o_old = _view({s: p_s}, labels, s, i, params), _view(o_s, state_labels, s, i)
    # the layer's new values whole before any is written (a conditional's results): else XLA fuses each write with
    # the update's reads of the old moments and copies the carried stacks to keep those reads apart from the writes
    p_new, o_new = jax.lax.cond(apply, lambda: _apply(opt, p_old, o_old, optim_lib.clip(only(s, {s: g}), grad_norm,
                                                                                          max_norm)),
                                lambda: (p_old, o_old))
    return _put(p_s, p_new[s], labels[s], s, i), _put(o_s, o_new, state_labels, s, i)
  g_outer, done = backward(step_layer, {s: (params[s], _view(opt_state, state_labels, s)) for s in names},
                           lambda s, c: c[0])
  p_out, o_out = _apply(opt, _view(params, labels, OUTER), _view(opt_state, state_labels, OUTER),
                        optim_lib.clip(only(OUTER, g_outer), grad_norm, max_norm))
  new_params = {k: (done[k][0] if k in names else jax.tree.map(pick, p_out[k], v)) for k, v in params.items()}
  new_opt = jax.tree.map(lambda old, lab, out, *stacked: pick(out, old) if lab in (OUTER, "") else
                         stacked[names.index(lab)], opt_state, state_labels, o_out, *(done[s][1] for s in names))
  return new_params, new_opt


def _empty(x):
  return jnp.zeros((0,), x.dtype)


def _view(tree, labels, group, i=None, like=None):
  """`tree` (params, or the optimizer state) seen by one group's update: the group's leaves (layer `i` of a stack's),
  the optimizer's counts as they are, every other leaf empty (the update is elementwise). `like`: the whole params,
  where `tree` holds the group's part alone."""
  if like is not None:
    tree = {k: tree.get(k, v) for k, v in like.items()}
  def one(x, lab):
    if lab == "":
      return x
    if lab != group:
      return _empty(x)
    return x if i is None else x[i]
  return jax.tree.map(one, tree, labels)


def _put(tree, new, labels, group, i):
  """`tree` with layer `i` of the group's leaves set to `new`'s (in place: a carried buffer)."""
  def one(x, n, lab):
    return jax.lax.dynamic_update_index_in_dim(x, n, i, 0) if lab == group else x
  return jax.tree.map(one, tree, new, labels)


def _apply(opt, p_view, o_view, g_view):
  """(new params, new optimizer state) of AdamW's update on one group's view."""
  updates, o_new = opt.update(g_view, o_view, p_view)
  return optax.apply_updates(p_view, updates), o_new


def _stack_forward(layer, x_BxLxD, stacked):
  """The stack's forward as a scan of `jax.vjp`s: (output, (the residuals stacked, how to rebuild a layer's vjp)).
  The layer's parameters among the residuals are left out (the backward passes them back in): stacking them would
  copy the stack."""
  shape = {}

  def body(x, p):
    (y, stats), vjp = jax.vjp(layer, x, p)
    assert stats is None, "the update in the backward runs dense layers only"
    leaves, shape["tree"] = jax.tree.flatten(vjp)
    own = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves(p))}
    shape["where"] = [own.get(id(leaf)) for leaf in leaves]
    return y, [leaf for leaf in leaves if id(leaf) not in own]
  y, res = jax.lax.scan(body, x_BxLxD, stacked)
  return y, (res, shape)


def _stack_backward(stack, dy_BxLxD, carry, consume, read):
  """The stack's backward, last layer first: dy of its output -> dy of its input; `consume(i, gradient, carry)` gets
  each layer's parameter gradient, the layer's parameters read from `read(carry)` (the stack's, or the carried copy
  the update pass writes in place)."""
  res, shape = stack

  def body(c, xs):
    dy, inner = c
    i, kept = xs
    p_leaves = [a[i] for a in jax.tree.leaves(read(inner))]
    it = iter(kept)
    leaves = [next(it) if k is None else p_leaves[k] for k in shape["where"]]
    dx, g = jax.tree.unflatten(shape["tree"], leaves)((dy, None))
    return (dx, consume(i, g, inner)), None
  n = jax.tree.leaves(read(carry))[0].shape[0]
  (dy_BxLxD, carry), _ = jax.lax.scan(body, (dy_BxLxD, carry), (jnp.arange(n), res), reverse=True)
  return dy_BxLxD, carry
