"""Gradient accumulation with one reduction over `data` per update (docs/parallelism.md#data).

Under automatic sharding each microbatch's gradient is reduced over `data` as soon as it is added to an
accumulator that lives replicated (or split, ZeRO-2) over `data`: k reductions per update on the axis that crosses
hosts. Here the microbatch executor runs in a region manual over `data`: every device accumulates the gradient of
its own rows, unreduced, and the sum is all-reduced once after the last microbatch (where: `wanted`). Other axes stay automatic inside (fsdp's reduce-scatter of each
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


def wanted(plan) -> bool:
  """Where the region runs: `data` > 1 and more than one microbatch (one is reduced once by XLA anyway, layer by
  layer inside the backward: better overlap, and ZeRO-2's gradients never whole), except ZeRO-2, whose point is
  gradients split over data: an unreduced accumulator would be whole on every device, so it keeps one
  reduce-scatter per microbatch (as DeepSpeed's stage 2 does)."""
  mesh, cfg = plan.mesh, plan.cfg
  return (mesh is not None and mesh.shape.get(AXIS, 1) > 1 and cfg.train.microbatches > 1
          and plan.zero_stage != 2)


def once_over_data(executor):
  """`executor` (objective, params, mbs, w, grad_sharding) -> (loss sum, gradient sum, MoE totals), with the
  gradients reduced over `data` once, after every microbatch; the plan installed around the step says the mesh."""

  def run(objective, params, mbs, w, grad_sharding=None):
    plan = ops.current()
    mesh = plan.mesh
    trained = roles.split(objective.cfg.model, params)[0]  # what has a gradient (LoRA: the adapters)
    specs = jax.tree.map(lambda _: P(), trained)  # reduced whole: ZeRO-2, split over data, does not come here
    wire = wire_dtypes(objective.cfg.model, trained, plan.platform)

    def region(params, mbs, w):
      inner = _inner_plan(plan)
      with ops.use(inner):
        keep = None if grad_sharding is None else jax.tree.map(
            lambda sh: NamedSharding(inner.mesh, _without_data(sh.spec)), grad_sharding)
        loss_sum, g, moe = executor(objective, params, mbs, w, keep)
      g = jax.tree.map(lambda x, dt: jax.lax.psum(x.astype(dt), AXIS).astype(x.dtype), g, wire)
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
