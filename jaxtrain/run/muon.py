"""Muon's update for the projection matrices (optim.name=muon, docs/training.md#muon): Nesterov momentum, its
bias-corrected value orthogonalized by five quintic Newton-Schulz iterations on each matrix, scaled by
RMS_MATCH * sqrt(max(inputs, outputs)) so that its RMS is about AdamW's (Moonshot's rule: learning rates and weight
decay carry over). A parameter is a batch of matrices: its role's `lead` axes (a scanned stack's layers, MoE's
experts) hold separate matrices, its input axes (up to `in_axis`) are the rows, the rest the columns.

Newton-Schulz needs the whole matrix. Each matrix is cast to the orthogonalization dtype and gathered whole (a
sharding constraint: only its lead axes stay split), one layer of a stack at a time (`lax.map`), orthogonalized
on every device that holds it, and constrained back to the momentum's sharding (each device keeps its slice)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import roles
from jaxtrain.run import moments

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the standard quintic (Jordan's): steepest slope at 0 that stays bounded
NS_STEPS = 5
# Moonshot (Liu et al. 2025): AdamW's update RMS is about 0.2-0.4; an orthogonal m x n matrix's is 1/sqrt(max(m, n))
RMS_MATCH = 0.2
# Every singular value stays in [0, 1.2025] through the quintic p(s) = a s + b s^3 + c s^5 (p's maximum on it, at
# s = 0.5545, is 1.2025 and p > 0 there), and a Frobenius-normalized input starts inside: an entry of the output is at
# most its spectral norm. 1.5 leaves room for the roundings of a low-precision orthogonalization.
NS_ENTRY_BOUND = 1.5


class MuonState(NamedTuple):
  count: jax.Array  # int32 updates made
  mu: optax.Updates  # the momentum, shaped like the matrices, kept as optim.state_dtype says (run/moments.py)


def matrix_dims(role: roles.Role, shape) -> tuple[int, int]:
  """(inputs, outputs) of one matrix of a parameter with this role and shape."""
  return math.prod(shape[role.lead:role.in_axis + 1]), math.prod(shape[role.in_axis + 1:])


def update_scale(role: roles.Role, shape) -> float:
  """The factor on the orthogonalized update: RMS_MATCH * sqrt(max(inputs, outputs))."""
  return RMS_MATCH * math.sqrt(max(matrix_dims(role, shape)))


def newton_schulz(x_MxN, eps: float, pin=None):
  """Quintic Newton-Schulz on one matrix: normalized by its Frobenius norm + eps, then NS_STEPS iterations
  X <- aX + (bA + cA A)X, A = XX^T, on the wide orientation (A the smaller Gram matrix). `orthogonalize` vmaps it
  over a parameter's lead axes. `pin`: applied to each iterate (keeps a gathered matrix whole: XLA would otherwise
  split the products again and gather at every iteration)."""
  pin = pin or (lambda z: z)
  tall = x_MxN.shape[0] > x_MxN.shape[1]
  x = x_MxN.T if tall else x_MxN
  x = pin(x / (jnp.linalg.norm(x, ord='fro') + eps))
  a, b, c = NS_COEFFS
  for _ in range(NS_STEPS):
    gram = x @ x.T
    x = pin(a * x + (b * gram + (c * gram) @ gram) @ x)
  return x.T if tall else x


def orthogonalize(x, role: roles.Role, sharding: NamedSharding | None, dtype, eps: float):
  """Muon's direction for one parameter `x` (float32, `role`), in float32 again: its matrices as one batch (as
  optax.contrib lays them out). `sharding`: the momentum's; where it splits a matrix, each matrix is gathered whole
  in `dtype`, one layer of a stack at a time; where it does not (None, one device, only lead axes split) the whole
  parameter at once, as it lies."""
  m, n = matrix_dims(role, x.shape)
  matrix_axes = x.ndim - role.lead

  def one(x, spec):  # the parameter, or one layer of its stack
    y = x.astype(dtype)
    if spec is not None:  # all-gather the matrix axes (in `dtype`): NS reads the whole matrix
      y = jax.lax.with_sharding_constraint(y, NamedSharding(sharding.mesh, P(*spec[:y.ndim - matrix_axes])))
    pin, lead = None, None
    if spec is not None:  # each matrix whole on each device; a split lead axis (experts) stays split
      pin = lambda z: jax.lax.with_sharding_constraint(z, NamedSharding(sharding.mesh, P()))  # noqa: E731
      lead = spec[0] if y.ndim > matrix_axes else None
    o = jax.vmap(lambda z: newton_schulz(z, eps, pin), spmd_axis_name=lead)(y.reshape(-1, m, n))
    o = o.reshape(y.shape).astype(x.dtype)
    if spec is not None:  # back to this device's slice
      o = jax.lax.with_sharding_constraint(o, NamedSharding(sharding.mesh, P(*spec)))
    return o

  spec = None if sharding is None else tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if spec is not None and all(s is None for s in spec[role.lead:]):  # its matrices are whole on each device
    spec = None
  if spec is None or not role.stacked:
    return one(x, spec)
  return jax.lax.map(lambda xi: one(xi, spec[1:]), x)  # one layer's matrices gathered at a time


def scale_by_muon(beta: float, eps: float, model_cfg, shardings, dtype,
                  state_dtype: str = "float32") -> optax.GradientTransformation:
  """Nesterov momentum (bias-corrected as optax.contrib.muon does), orthogonalized and scaled by `update_scale`.
  `shardings`: the momentum's NamedShardings, a tree like the params (None: no constraints). `state_dtype`: how the
  momentum is kept between updates (`moments.Store`, signed)."""
  store = moments.Store(state_dtype, True)
  where = {} if shardings is None else {roles.keys_of(p): sh
                                        for p, sh in jax.tree_util.tree_leaves_with_path(shardings)}

  def init(params):
    return MuonState(jnp.zeros([], jnp.int32), jax.tree.map(store.zeros, params))

  def direction(path, x):
    role = roles.of(model_cfg, path)
    return update_scale(role, x.shape) * orthogonalize(x, role, where.get(roles.keys_of(path)), dtype, eps)

  def update(g, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu = optax.tree.update_moment(g, store.tree(store.load, state.mu), beta, 1)
    nesterov = jax.tree.map(lambda m, x: beta * m + (1 - beta) * x,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(g, beta, count))
    kept = store.tree(lambda s, x: store.save(x, s), state.mu, mu)
    return jax.tree_util.tree_map_with_path(direction, nesterov), MuonState(count, kept)
  return optax.GradientTransformation(init, update)
