"""Gradient accumulation with one reduction over `data` per update (docs/parallelism.md#data).

Under automatic sharding each microbatch's gradient is reduced over `data` as soon as it is added to an
accumulator that lives replicated (or split, ZeRO-2) over `data`: k reductions per update on the axis that crosses
hosts. Here the microbatch executor runs in a region manual over `data`: every device accumulates the gradient of
its own rows, unreduced, and the sum is reduced once after the last microbatch (an all-reduce; a reduce-scatter
onto the gradients' split with ZeRO-2). Other axes stay automatic inside (fsdp's reduce-scatter of each
microbatch's gradient stays where it was: within the fast domain). Statistics the objective needs over the whole
microbatch (the MoE balance loss's means) are averaged over `data` in the forward (`Plan.batch_mean`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import ops, roles
from jaxtrain.parallel import sharding

AXIS = "data"


def active(mesh) -> bool:
  return mesh is not None and mesh.shape.get(AXIS, 1) > 1


def once_over_data(executor):
  """`executor` (objective, params, mbs, w, grad_sharding) -> (loss sum, gradient sum, MoE totals), with the
  gradients reduced over `data` once, after every microbatch; the plan installed around the step says the mesh."""

  def run(objective, params, mbs, w, grad_sharding=None):
    plan = ops.current()
    mesh = plan.mesh
    specs = jax.tree.map(lambda _: P(), params) if grad_sharding is None else jax.tree.map(
        lambda sh: _data_only(sh.spec), grad_sharding)
    wire = wire_dtypes(objective.cfg.model, params, plan.platform)

    def region(params, mbs, w):
      inner = _inner_plan(plan)
      with ops.use(inner):
        keep = None if grad_sharding is None else jax.tree.map(
            lambda sh: NamedSharding(inner.mesh, _without_data(sh.spec)), grad_sharding)
        loss_sum, g, moe = executor(objective, params, mbs, w, keep)
      g = jax.tree.map(_reduce, g, specs, wire)
      moe = {k: (jax.lax.pmean if k == "aux" else jax.lax.psum)(v, AXIS) for k, v in moe.items()}
      return jax.lax.psum(loss_sum, AXIS), g, moe

    rows = jax.tree.map(lambda x: P(None, AXIS), mbs)  # (k, rows, ...): each device its rows of each microbatch
    return sharding.manual(region, mesh, (P(), rows, P()), (P(), specs, P()), axis_names={AXIS})(params, mbs, w)
  return run


def _inner_plan(plan):
  """The plan as seen inside the region: `data` is manual, so the rules no longer split over it."""
  rules = {k: tuple(a for a in v if a != AXIS) for k, v in plan.rules.items()}
  return dataclasses.replace(plan, mesh=jax.sharding.get_abstract_mesh(), rules=rules,
                             rows_over=(*plan.rows_over, AXIS))


def _without_data(spec: P) -> P:
  return P(*(_entry(tuple(a for a in sharding.axes_of(e) if a != AXIS)) for e in spec))


def _data_only(spec: P) -> P:
  """The gradient's split over `data` alone (its other axes stay automatic at the region's edge)."""
  return P(*(AXIS if AXIS in sharding.axes_of(e) else None for e in spec))


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def wire_dtypes(model_cfg, params, platform: str):
  """The dtype each gradient crosses `data` in: bfloat16 for a bfloat16 model's matmul weights (their gradient is
  a bfloat16 product: half the float32 bytes, the dtype XLA reduced it in when it reduced each microbatch), else
  the gradient's float32 (float16 too: a sum of loss-scaled gradients would overflow it)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: wire_dtype(model_cfg, roles.of(model_cfg, path), platform), params)


def wire_dtype(model_cfg, role, platform: str) -> jnp.dtype:
  """One parameter's (see `wire_dtypes`). XLA:CPU keeps float32: a bfloat16 all-reduce in a manual region aborts
  its all-reduce promotion pass (jax 0.10.2, "Invalid binary instruction opcode copy")."""
  low = jnp.dtype(model_cfg.dtype) == jnp.bfloat16 and role.low_gradient and platform != "cpu"
  return jnp.dtype(jnp.bfloat16 if low else jnp.float32)


def _reduce(g, spec: P, wire):
  """The devices' partial sums of one gradient added, in the `wire` dtype: all of it on each (all-reduce), or each
  its `data` part (reduce-scatter) where the gradients are split over data (ZeRO-2; `data` leads that split)."""
  x = g.astype(wire)
  for dim, e in enumerate(spec):
    if e == AXIS:
      return jax.lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True).astype(g.dtype)
  return jax.lax.psum(x, AXIS).astype(g.dtype)
