"""The update for master weights and Adam moments kept in host memory (optim.offload=host): one unit at a time comes
to the device, is updated there and goes back, so the device never holds the whole float32 state. A unit is a
non-layer parameter (embedding, head, final norm, MTP), or one layer (a slice of each stack under scan_layers)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import moe_balance
from jaxtrain.run.optimizer import all_finite


# What one step moves over each device's host link, by this module's design: the float32 master comes to the device
# for the forward (layout.compute_copy) and for each of the update's two passes, the Adam moments (as
# optim.state_dtype keeps them) for each pass, and master and moments go back once, from the pass that writes (the
# first pass's results are dropped).
MASTER_FETCHES, MOMENT_FETCHES, WRITES = 3, 2, 1


def link_bytes(stored, abstract_params, opt_sh, opt_shapes) -> tuple[int, int]:
  """(host-to-device, device-to-host) bytes per step over one device's host link: its shard of each stored array
  (`stored`: the master's shardings, `abstract_params`: their shapes; `opt_sh`, `opt_shapes`: the optimizer state's,
  whose arrays beyond its scalar counts are the moments), as the update moves them. Where the layers are not
  scanned, XLA may merge the forward's fetch of a weight with the first pass's: then it moves less."""
  shard = lambda sh, x, size: math.prod(sh.shard_shape(x.shape)) * size  # noqa: E731
  master = sum(jax.tree.leaves(jax.tree.map(lambda sh, x: shard(sh, x, 4), stored, abstract_params)))  # float32
  state = sum(shard(sh, x, x.dtype.itemsize) for sh, x in zip(jax.tree.leaves(opt_sh), jax.tree.leaves(opt_shapes),
                                                              strict=True) if x.ndim)
  return MASTER_FETCHES * master + MOMENT_FETCHES * state, WRITES * (master + state)


def _clip(g, clip_norm, max_norm: float):
  """optax's clip_by_global_norm, with the norm of the whole gradient given: applied unit by unit."""
  if max_norm <= 0:
    return g
  trigger = clip_norm < max_norm
  return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / clip_norm.astype(t.dtype)) * max_norm), g)


def _layer_picks(master, i):
  """(pick, pick of a shardings tree, pick of a sparse tree) of layer i of every params-shaped dict."""
  stacked = not all(isinstance(k, int) for k in master["layers"])  # scan_layers: one stack per weight
  if not stacked:
    pick = lambda d: {"layers": {i: d["layers"][i]}}  # noqa: E731
    return pick, pick, lambda s: pick(s) if s and i in s.get("layers", {}) else None
  take = lambda d: {"layers": jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False),  # noqa: E731
                                           d["layers"])}
  slice_sh = lambda d: {"layers": jax.tree.map(  # noqa: E731
      lambda sh: NamedSharding(sh.mesh, P(*sh.spec[1:]), memory_kind=sh.memory_kind), d["layers"])}
  return take, slice_sh, lambda s: take(s) if s and "layers" in s else None


class Streamer:
  """The units of one update, AdamW (`adamw` of `optimizer.parts`) on each. `shardings`: ((device master, device
  state), (host master, host state)), the state's params-shaped dicts flattened as in `flat`."""

  def __init__(self, adamw, master, opt_state, g, shardings, bias_delta):
    self.adamw, self.g, self.delta = adamw, g, bias_delta
    self.keys = master.keys()
    self.leaves, self.treedef = self.flat(opt_state)
    (self.dev_m, self.dev_s), (self.host_m, self.host_s) = [(m, self.flat(st)[0]) for m, st in shardings]

  def flat(self, tree, keys=None):
    """AdamW's state as leaves, each params-shaped dict (mu, nu; with these `keys`, default the master's) one leaf."""
    keys = self.keys if keys is None else keys
    return jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, dict) and x.keys() == keys)

  def unit(self, picks, m_tree, s_leaves, apply, after):
    """AdamW on what `picks` take of a params-shaped dict, fetched once `after` (the previous unit's flag) is known;
    the new (master, state leaves) back in host memory, and whether the new master is finite. `apply` None: the
    first pass (nothing kept), else where it is false the old values stay."""
    pick, pick_sh, pick_sparse = picks
    sub = lambda leaves, f: [f(x) if isinstance(x, dict) else x for x in leaves]  # noqa: E731
    p, st = pick(m_tree), sub(s_leaves, pick)
    if after is not None:  # fori_loop's iterations are in order already (a barrier there costs a copy on CPU)
      p, st, _ = jax.lax.optimization_barrier((p, st, after))
    p, st = jax.device_put((p, st), (pick_sh(self.dev_m), sub(self.dev_s, pick_sh)))
    upd, new_st = self.adamw.update(pick(self.g), self.treedef.unflatten(st), p)
    new_p = moe_balance.add(optax.apply_updates(p, upd), pick_sparse(self.delta))  # the bias moves where it lives
    new_st = self.flat(new_st, p.keys())[0]
    if apply is not None:
      new_p, new_st = jax.tree.map(lambda n, o: jnp.where(apply, n, o), (new_p, new_st), (p, st))
    return jax.device_put((new_p, new_st), (pick_sh(self.host_m), sub(self.host_s, pick_sh))), all_finite(new_p)

  def layer(self, master, i, carry, apply):
    m_l, s_l, fin = carry
    it = iter(s_l)
    s_list = [{"layers": next(it)} if isinstance(x, dict) else x for x in self.leaves]
    stacked = not isinstance(i, int)
    (new_p, new_st), f = self.unit(_layer_picks(master, i), {"layers": m_l}, s_list, apply, None if stacked else fin)
    if apply is None:
      return m_l, s_l, fin & f
    new_p, new_l = new_p["layers"], [x["layers"] for x in new_st if isinstance(x, dict)]
    if not stacked:  # the layers dict, one layer replaced
      return {**m_l, i: new_p[i]}, [{**c, i: x[i]} for c, x in zip(s_l, new_l)], fin & f
    put = lambda c, x: jax.lax.dynamic_update_index_in_dim(c, x, i, 0)  # noqa: E731
    return jax.tree.map(put, m_l, new_p), jax.tree.map(put, s_l, new_l), fin & f

  def stream(self, master, apply):
    """One pass over the units: (new non-layer master, their state leaves, (layers master, layers state, finite))."""
    fin, rest_p, rest_s = jnp.bool_(True), {}, None
    for k in (k for k in master if k != "layers"):  # embedding, head, final norm, MTP: a unit each
      pick = lambda d, k=k: {k: d[k]}  # noqa: E731
      picks = (pick, pick, lambda s, k=k: moe_balance.pick(s, [k]))
      (p, st), f = self.unit(picks, master, self.leaves, apply, fin)
      fin, rest_p = fin & f, {**rest_p, **p}
      rest_s = st if rest_s is None else [{**a, **b} if isinstance(a, dict) else a for a, b in zip(rest_s, st)]
    carry = (master["layers"], [x["layers"] for x in self.leaves if isinstance(x, dict)], fin)
    body = lambda i, c: self.layer(master, i, c, apply)  # noqa: E731
    if not all(isinstance(k, int) for k in master["layers"]):
      carry = jax.lax.fori_loop(0, jax.tree.leaves(master["layers"])[0].shape[0], body, carry)
    else:
      for i in master["layers"]:
        carry = body(i, carry)
    return rest_p, rest_s, carry


def streamed_update(parts, shardings, clip_norm, master, opt_state, g, ok, bias_delta=None):
  """`optimizer.guarded_update` for master and moments in host memory: the clip factor comes from the whole
  gradient's norm (`clip_norm`), AdamW's counts are shared, so each unit's update is the one optax makes on the
  whole tree. Two passes over the units, as the update is all or nothing: the first only learns whether every new
  parameter is finite, the second writes. `parts`: `optimizer.parts`."""
  max_norm, adamw = parts
  s = Streamer(adamw, master, opt_state, _clip(g, clip_norm, max_norm), shardings, bias_delta)
  apply = ok & s.stream(master, None)[2][2]
  rest_p, rest_s, (m_l, s_l, _) = s.stream(master, apply)
  it = iter(s_l)
  new_s = [{**x, "layers": next(it)} if isinstance(x, dict) else x for x in rest_s]
  return {**rest_p, "layers": m_l}, s.treedef.unflatten(new_s), apply

