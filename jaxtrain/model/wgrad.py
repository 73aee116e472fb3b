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


def probes(w, tokens: tuple[int, ...], n_in: int, lead: int, dtype) -> Tapped:
  """`w` tapped, with zero probes for `tokens` (the microbatch's (rows, length)); `n_in`: the weight's input
  dimensions after its `lead` stack axes."""
  stack, inner = w.shape[:lead], w.shape[lead:]
  zeros = lambda dims: jnp.zeros((*stack, *tokens, *dims), dtype)  # noqa: E731
  return Tapped(w, zeros(inner[:n_in]), zeros(inner[n_in:]))


def wrap(tree, deferred, probe_pairs):
  """`tree` (a chunk's parameters) with each leaf `deferred` marks (jax.tree order) Tapped with the next (x, dy)
  zeros of `probe_pairs`."""
  leaves, tdef = jax.tree.flatten(tree)
  pairs = iter(probe_pairs)
  return tdef.unflatten([Tapped(a, *next(pairs)) if d else a for a, d in zip(leaves, deferred)])


def zero_probes(tree, deferred, n_in, tokens: tuple[int, ...], lead: int, dtype) -> list[tuple]:
  """The (x, dy) zeros of each deferred leaf of `tree` (its stack's `lead` axes first)."""
  return [(t.x, t.dy) for t in (probes(a, tokens, k, lead, dtype)
                               for a, d, k in zip(jax.tree.leaves(tree), deferred, n_in) if d)]


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
