"""Muon's update for the projection matrices (optim.name=muon, docs/training.md#muon): Nesterov momentum, its
bias-corrected value orthogonalized by five quintic Newton-Schulz iterations on each matrix, scaled by
RMS_MATCH * sqrt(max(inputs, outputs)) so that its RMS is about AdamW's (Moonshot's rule: learning rates and weight
decay carry over). A parameter is a batch of matrices: its role's `lead` axes (a scanned stack's layers, MoE's
experts) hold separate matrices, its input axes (up to `in_axis`) are the rows, the rest the columns.

Newton-Schulz needs the whole matrix. Where the momentum's sharding splits a matrix, `route` decides how it
becomes whole (docs/training.md#muon): a batch of matrices (a device's slice of the lead axes: a scanned stack's
layers, a pipeline stage's, experts) goes to owner devices, an all-to-all that moves the split from the matrix axes
to the batch axis, so each device of the group orthogonalizes whole matrices of its share and sends them back; a
lone matrix (an unscanned layer's, one expert per device) is gathered whole in the orthogonalization dtype on every
device that holds it, one layer of a stack at a time (`lax.map`), and constrained back to the momentum's sharding
(each device keeps its slice)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import roles
from jaxtrain.parallel import sharding as sharding_lib
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


class Route(NamedTuple):
  """How one parameter's matrices become whole for Newton-Schulz (`route`)."""
  way: str  # "local" (no matrix is split), "owner" (all-to-all to owner devices), "gather" (all-gather on each)
  moved: tuple[str, ...] = ()  # the mesh axes that split a matrix: the group that shares the work
  batch: int = 1  # matrices in a device's slice of the lead axes (the owner route's batch), before padding
  group: int = 1  # devices of `moved`


def full_spec(sharding: NamedSharding | None, ndim: int):
  """The sharding's spec entry of each axis (None: none), or None without a sharding."""
  if sharding is None:
    return None
  return tuple(e if e else None for e in sharding.spec) + (None,) * (ndim - len(sharding.spec))


def route(role: roles.Role, shape, spec, mesh) -> Route:
  """The one place that decides. Owner devices wherever a device's slice of the lead axes holds two matrices or
  more (a stack's layers, or a stage's, experts): each device of the group then orthogonalizes
  ceil(batch / group) of them instead of all `batch`, for the same bytes moved (an all-to-all there and back
  instead of an all-gather). The batch is padded with zero matrices to a multiple of the group (zero stays zero
  through Newton-Schulz): a device then does ceil(batch / group) matrices, fewer than gathering the remainder on
  every device would cost (floor(batch / group) + the remainder). A lone matrix is gathered: owning it on one
  device would leave the rest idle for the same time."""
  axes = tuple(a for e in (spec or ())[role.lead:] for a in sharding_lib.axes_of(e) if mesh.shape[a] > 1)
  if not axes:
    return Route("local")
  batch = math.prod(shape[i] // sharding_lib.ways(spec[i], mesh) for i in range(role.lead))
  group = math.prod(mesh.shape[a] for a in axes)
  return Route("owner" if batch > 1 else "gather", axes, batch, group)


def _without(entry, axes):
  """A spec entry less the mesh axes `axes` (None when none is left)."""
  left = tuple(a for a in sharding_lib.axes_of(entry) if a not in axes)
  return left or None


def _vmap_ns(y, eps: float, pin, axis_names):
  """Newton-Schulz over y's leading axes (one vmap each; `axis_names`: the mesh axes that split each, outermost
  first), each matrix pinned whole by `pin`."""
  fn = lambda z: newton_schulz(z, eps, pin)  # noqa: E731
  for name in reversed(axis_names):
    fn = jax.vmap(fn, spmd_axis_name=name)
  return fn(y)


def _owner(x, role: roles.Role, spec, mesh, r: Route, dtype, eps: float):
  """The owner route: each split lead axis cut into (its devices, its local extent), the local extents and the
  unsplit lead axes merged into one batch axis padded to a multiple of the group; an all-to-all moves the matrix
  axes' split onto that batch axis; Newton-Schulz on this device's whole matrices; the reverse all-to-all; the
  padding dropped and the axes put back."""
  lead, m, n = role.lead, *matrix_dims(role, x.shape)
  split = [i for i in range(lead) if spec[i] is not None]
  whole = [i for i in range(lead) if spec[i] is None]
  mat = list(range(lead, x.ndim))
  ways = [sharding_lib.ways(spec[i], mesh) for i in split]
  constrain = lambda z, *s: jax.lax.with_sharding_constraint(z, NamedSharding(mesh, P(*s)))  # noqa: E731
  # cast where the momentum lies: else XLA moves the float32 momentum and gradient and forms the Nesterov value there
  y = jnp.transpose(constrain(x.astype(dtype), *spec), split + whole + mat)
  y = y.reshape(*(d for w, i in zip(ways, split) for d in (w, x.shape[i] // w)), *y.shape[len(split):])
  k = len(split)  # (w1, l1, w2, l2, ..) -> (w1, w2, .., l1, l2, ..): each device's slices in one batch axis
  y = jnp.transpose(y, [*range(0, 2 * k, 2), *range(1, 2 * k, 2), *range(2 * k, y.ndim)])
  y = y.reshape(*ways, r.batch, *(x.shape[i] for i in mat))
  pad = -r.batch % r.group
  if pad:
    y = jnp.pad(y, [(0, pad) if d == k else (0, 0) for d in range(y.ndim)])
  kept = [spec[i] for i in split]
  # all-to-alls, one matrix axis's split at a time: XLA's partitioner moves a split between two dims in one
  # all-to-all, but gathers whole when two dims' splits move at once
  ends = sorted(set(itertools.accumulate(
      (sum(a in r.moved for a in sharding_lib.axes_of(spec[i])) for i in mat), initial=0)))
  steps = [(r.moved[:e], [_without(spec[i], r.moved[:e]) for i in mat]) for e in ends]
  for on_batch, on_matrix in steps[1:]:
    y = constrain(y, *kept, on_batch or None, *on_matrix)
  pin = lambda z: constrain(z)  # noqa: E731
  o = _vmap_ns(y.reshape(*y.shape[:k + 1], m, n), eps, pin, [*kept, r.moved]).reshape(y.shape)
  for on_batch, on_matrix in reversed(steps[:-1]):  # and back: each device its slice of every matrix
    o = constrain(o, *kept, on_batch or None, *on_matrix)
  o = o[tuple(slice(0, r.batch) if d == k else slice(None) for d in range(o.ndim))]
  o = o.reshape(*ways, *(x.shape[i] // w for w, i in zip(ways, split)), *(x.shape[i] for i in whole + mat))
  o = jnp.transpose(o, [d for j in range(k) for d in (j, k + j)] + list(range(2 * k, o.ndim)))
  o = o.reshape(*(x.shape[i] for i in split + whole + mat))
  return jnp.transpose(o, [(split + whole + mat).index(i) for i in range(x.ndim)]).astype(x.dtype)


def orthogonalize(x, role: roles.Role, sharding: NamedSharding | None, dtype, eps: float):
  """Muon's direction for one parameter `x` (float32, `role`), in float32 again: its matrices as one batch (as
  optax.contrib lays them out). `sharding`: the momentum's; `route` decides how a split matrix becomes whole (owner
  devices, or gathered in `dtype` one layer of a stack at a time); where nothing splits a matrix (None, one device,
  only lead axes split) the whole parameter at once, as it lies."""
  m, n = matrix_dims(role, x.shape)
  matrix_axes = x.ndim - role.lead
  spec = full_spec(sharding, x.ndim)
  r = route(role, x.shape, spec, None if sharding is None else sharding.mesh)
  if r.way == "owner":
    return _owner(x, role, spec, sharding.mesh, r, dtype, eps)

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

  if r.way == "local":
    return one(x, None)
  if not role.stacked:
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
