"""inspect's pipeline section: the schedule's F/B/W timeline, its bubble with unit costs (= the formula) and
with each slot's cost from XLA's cost analysis of one chunk's forward, input-gradient and weight-gradient
functions (devices run in lock-step: a tick lasts its slowest op), the stash, and what B hands to W."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.model import roles, transformer as model_lib, wgrad
from jaxtrain.model.layers import rope_tables
from jaxtrain.parallel import pipeline, program, schedule as schedule_lib


def slot_costs(setup) -> dict:
  """XLA's FLOPs (lowered, per pipeline device) of one middle chunk on one microbatch: F, B and W as the
  program runs them (B recomputes the forward and hands each projection's input and output gradient to W, which
  makes only their weight gradients), the whole backward, and the bytes B hands to W per pass."""
  # lowered for one local device: FLOPs do not depend on the layout (the target's compiler may give no analysis)
  cfg, mc = setup.cfg, setup.cfg.model
  t = pipeline.table(cfg, setup.mesh)
  lc, rows, L = mc.n_layers // t.chunks, cfg.train.batch_size // cfg.train.microbatches, cfg.train.seq_len
  params = nnx.to_pure_dict(setup.abstract_params)
  rest = {k: v for k, v in params.items() if k != "layers"}
  # one layer: XLA's cost analysis counts a loop's body once, so the scan over a chunk's layers would
  # show one layer whatever its length; all layers cost the same
  chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), params["layers"])
  x = jax.ShapeDtypeStruct((rows, L, mc.d_model), jnp.dtype(mc.dtype))
  pos = jax.ShapeDtypeStruct((rows, L), jnp.int32)
  layer_roles = jax.tree.leaves(roles.tree(mc, {"layers": params["layers"]}))
  deferred, n_in = [r.deferred for r in layer_roles], [r.n_in for r in layer_roles]
  probes = jax.eval_shape(lambda c: wgrad.zero_probes(c, deferred, n_in, (rows, L), 1, x.dtype), chunk)

  def objective(c, x, dy, pos, rest, probes=None):  # <y, dy>: its gradients are the chunk's vjp with dy
    c = c if probes is None else wgrad.wrap(c, deferred, probes)
    model = nnx.merge(setup.graphdef, {**rest, "layers": c})
    y, _ = model_lib.run_stack(model.layers, x, rope_tables(pos, mc), jnp.zeros_like(pos), mc.remat,
                               windows=mc.layer_windows()[:1])
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  def split_b(c, x, dy, pos, rest):  # the input, the parameters W does not make, the probes
    return wgrad.split_grad(objective, c, deferred, zeros(probes), x, dy, pos, rest, argnums=(0,))

  def split_w(kept):
    return [wgrad.weight_grad(a, b, lead=1) for a, b in kept]

  fns = {"F": objective, "B": split_b, "BW": jax.grad(objective, argnums=(0, 1))}
  args = (chunk, x, x, pos, rest)
  flops = {k: jax.jit(f).lower(*args).cost_analysis()["flops"] for k, f in fns.items()}
  flops["W"] = jax.jit(split_w).lower(probes).cost_analysis()["flops"] if probes else 0.0
  kept = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(probes))
  ways = setup.mesh.size // pipeline.stages(setup.mesh)  # one pipeline stage's devices share a microbatch
  return {**{k: v * lc / ways for k, v in flops.items()}, "w_bytes": kept * lc // ways}


def zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def op_costs(t, costs) -> dict:
  """{op kind: FLOPs} for `Table.span`/`bubble` from `slot_costs`: a split schedule's B and W, else the whole
  backward as B (a dualpipev whole backward is its B + W)."""
  F, B, W = schedule_lib.F, schedule_lib.B, schedule_lib.W
  return {F: costs["F"], B: costs["B"], W: costs["W"]} if t.split else {F: costs["F"], B: costs["BW"]}


def report(setup) -> dict:
  """The schedule for `inspect`: timeline, bubble (unit costs, formula, XLA-costed), stash per stage."""
  cfg, mesh = setup.cfg, setup.mesh
  t = pipeline.table(cfg, mesh)
  _, S, G, WN = program.program_table(t)
  costs = slot_costs(setup)
  per_op = op_costs(t, costs)
  return {"schedule": t.name, "stages": t.p, "virtual_stages": t.v, "microbatches": t.m, "ticks": t.ticks,
          "split": t.split, "bubble": t.bubble(), "bubble_formula": t.bubble_formula(),
          "bubble_costed": t.bubble(per_op), "span_costed": t.span(per_op), "slot_flops": costs,
          "in_flight": t.in_flight(),
          "passes_in_flight": t.passes_in_flight(), "stash_slots": S, "grad_slots": G, "w_slots": WN,
          "stash_bytes": (S + G) * pipeline.act_bytes(cfg, mesh), "timeline": t.timeline()}


def render(rep: dict) -> list[str]:
  back = ("B = input gradient, recomputing the forward, W = weight gradient, from what B hands it" if rep["split"]
          else "B = backward, recomputing the forward")
  L = [f"Pipeline schedule: {rep['schedule']}, {rep['stages']} stages x {rep['virtual_stages']} virtual, "
       f"{rep['microbatches']} microbatches, {rep['ticks']} ticks (F = forward, {back}; digit = microbatch"
       f"{', letter = chunk on the device' if rep['virtual_stages'] > 1 else ''}, "
       f"{'X = B and W at once, F+X = a pair in one tick, ' if rep['schedule'] == 'dualpipev' else ''}. = idle)"]
  L += ["  " + line for line in rep["timeline"].splitlines()]
  formula = {"dualpipev": "(5p-8)/(6m+5p-8)"}.get(
      rep["schedule"], "(p-1)/(3*v*m+p-1)" if rep["split"] else "(p-1)/(v*m+p-1)")
  c = rep["slot_flops"]
  ops = f"F {c['F']:.3g}, B {c['B']:.3g}, W {c['W']:.3g}" if rep["split"] else f"F {c['F']:.3g}, B {c['BW']:.3g}"
  L.append(f"  bubble: {rep['bubble']:.1%} of device-ticks idle in this table (unit costs); formula {formula} = "
           f"{rep['bubble_formula']:.1%}; {rep['bubble_costed']:.1%} of device time with XLA's FLOPs per slot "
           f"({ops}; a tick lasts its slowest op: the step takes {rep['span_costed']:.3g} FLOP-times per device)")
  L.append(f"  chunk inputs stashed at most, per stage: {rep['in_flight']} (buffers: {rep['stash_slots']} stash + "
           f"{rep['grad_slots']} gradient slots per device, {rep['stash_bytes']:,} bytes); chunk passes between "
           f"F and their last backward op, in stages: {rep['passes_in_flight']}")
  if rep["split"]:
    L.append(f"  W is only the projections' weight gradients, from the inputs and output gradients B hands it: B "
             f"{c['B']:.3g} + W {c['W']:.3g} = {(c['B'] + c['W']) / c['BW']:.3f} x one whole backward ({c['BW']:.3g} "
             f"FLOPs); {c['w_bytes']:,} bytes per pass wait from B to W, in {rep['w_slots']} slots per device "
             f"({rep['w_slots'] * c['w_bytes']:,} bytes)")
  return L
