"""Deferred weight gradients (the zero-bubble pipelines' W without recomputation). A projection y = x W has the
weight gradient x^T dy: the products of its input and its output's gradient over the tokens. A backward that
differentiates only w.r.t. the activations (a pipeline's B) computes every dy anyway; a `Tapped` weight makes it
hand over (x, dy) of its projection as the cotangents of two zero probes, and `weight_grad` later makes x^T dy
from them (the pipeline's W), with no forward or activation gradient computed again."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tapped:
  """A projection weight `w` (in..., out...) whose gradient is deferred: `x` zeros shaped like the projection's
  input (tokens..., in...), `dy` like its output (tokens..., out...); in a stack each has the stack's leading axes.
  Indexing reads the weight (the model's `self.w[...]`)."""
  w: jax.Array
  x: jax.Array
  dy: jax.Array

  def __getitem__(self, key):
    return self.w[key]


def wrap(tree, deferred, probe_pairs):
  """`tree` (a chunk's parameters) with each leaf `deferred` marks (jax.tree order) Tapped with the next (x, dy)
  zeros of `probe_pairs`."""
  leaves, tdef = jax.tree.flatten(tree)
  pairs = iter(probe_pairs)
  return tdef.unflatten([Tapped(a, *next(pairs)) if d else a for a, d in zip(leaves, deferred)])


def zero_probes(tree, deferred, n_in, tokens: tuple[int, ...], lead: int, dtype) -> list[tuple]:
  """The (x, dy) zeros of each deferred leaf of `tree`: (stack..., tokens..., in...) and (stack..., tokens...,
  out...), `lead` stack axes first; `n_in`: each leaf's input dimensions after them."""
  def pair(w, k):
    stack, inner = w.shape[:lead], w.shape[lead:]
    return tuple(jnp.zeros((*stack, *tokens, *dims), dtype) for dims in (inner[:k], inner[k:]))
  return [pair(a, k) for a, d, k in zip(jax.tree.leaves(tree), deferred, n_in) if d]


def split_grad(fn, tree, deferred, probe_pairs, *args, argnums=()):
  """B's gradient of fn(tree, *args, probes): w.r.t. the leaves of `tree` that `deferred` does not mark, `args` at
  `argnums` and the probes (each deferred projection's input and output gradient, handed over by `tap`), the
  deferred leaves held fixed. Returns ({leaf index: gradient}, (the args' gradients...), probe cotangents)."""
  leaves, tdef = jax.tree.flatten(tree)
  free = [i for i, d in enumerate(deferred) if not d]

  def of(free_leaves, probes, *args):
    mixed = list(leaves)
    for i, a in zip(free, free_leaves):
      mixed[i] = a
    return fn(tdef.unflatten(mixed), *args, probes)
  g = jax.grad(of, argnums=(0, 1, *(2 + k for k in argnums)))([leaves[i] for i in free], probe_pairs, *args)
  return dict(zip(free, g[0])), tuple(g[2:]), g[1]


def tap(var, x, y):
  """`y` = x through `var`'s weight; where that weight is Tapped, the backward hands (x, dy) to its probes."""
  t = var.get_raw_value()
  if not isinstance(t, Tapped):
    return y
  return _tap(jax.lax.stop_gradient(x), y, t.x, t.dy)


@jax.custom_vjp
def _tap(x, y, px, pdy):
  del x, px, pdy
  return y


def _tap_fwd(x, y, px, pdy):
  del px, pdy
  return y, x


def _tap_bwd(x, dy):
  # the probes' "gradients" are the projection's input and output gradient; x is a constant here (stop_gradient)
  return jnp.zeros_like(x), dy, x, dy


_tap.defvjp(_tap_fwd, _tap_bwd)


def weight_grad(x, dy, lead: int, tokens: int = 2):
  """x^T dy over the `tokens` axes after `lead` stack axes: (stack..., in..., out...), in the operands' dtype as
  autodiff of the projection makes it."""
  batch = tuple(range(lead))
  contract = tuple(range(lead, lead + tokens))
  return jax.lax.dot_general(x, dy, ((contract, contract), (batch, batch)))
