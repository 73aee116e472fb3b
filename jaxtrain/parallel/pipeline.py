"""Pipeline parallelism: one SPMD program, manual over `pipeline` only, that scans a static schedule and runs
per tick idle, forward or backward of one chunk (recomputing from the stashed input), the backward whole or
split into B (input gradient) and W (weight gradient); same math as `step.grads`."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain.core.errors import UserError
from jaxtrain.model import loss as xent, moe_balance, transformer as model_lib
from jaxtrain.parallel import placement as placement_lib, plan as plan_lib, schedule as schedule_lib, sharding

AXIS = "pipeline"
ACT = ("batch", "act_length", "act_embed")  # a chunk's input/output activation
IDLE, FWD, BWD, BWD_X, BWD_W = range(5)  # branches of the per-tick switch: BWD whole, or as B (X) and W
# columns of the per-(tick, device) table given to the program (XSLOT: where chunk 0's input gradient replaces
# its input), then one per link (`links`): the slot an activation (then a gradient) arriving over it lands in
BRANCH, MB, CHUNK, GCHUNK, SLOT, GSLOT, XSLOT = range(7)
NCOL = 7


def stages(mesh) -> int:
  return mesh.shape.get(AXIS, 1)


def active(mesh) -> bool:
  return stages(mesh) > 1


def check(cfg, mesh) -> None:
  """Pipeline config/mesh checks, as one-line user errors."""
  p = stages(mesh)
  if p == 1:
    return
  m, pc = cfg.model, cfg.pipeline
  if not m.scan_layers:
    raise UserError(f"mesh pipeline={p} needs model.scan_layers=true (stages hold slices of the stacked layers)")
  if len(m.stacks()) > 1:
    raise UserError(f"mesh pipeline={p} cannot split two layer stacks; model.moe_first_dense={m.moe_first_dense} "
                    "scans the dense first layers apart (use moe_first_dense=0 or no pipeline axis)")
  if m.n_layers % (p * pc.virtual_stages):
    raise UserError(f"model.n_layers={m.n_layers} must divide into pipeline={p} x pipeline.virtual_stages="
                    f"{pc.virtual_stages} = {p * pc.virtual_stages} stages of equal depth")
  if why := schedule_lib.check(pc.schedule, p, cfg.train.microbatches, pc.virtual_stages):
    raise UserError(why)
  if mesh.shape.get("sequence", 1) > 1:
    raise UserError(f"mesh pipeline={p} with sequence={mesh.shape['sequence']} is not supported; "
                    "pipeline composes with data, fsdp, tensor and expert")
  if m.moe_experts and m.moe_aux_convention == "hf":
    raise UserError(f"model.moe_aux_convention=hf is not supported with mesh pipeline={p} (its loss pools every "
                    "layer's routing before the product); use moe_aux_convention=jaxtrain")


def describe(cfg, mesh) -> str:
  """The start-up line of a pipelined run."""
  pc, p, t = cfg.pipeline, stages(mesh), table(cfg, mesh)
  return (f"pipeline: {pc.schedule}, {p} stages x {pc.virtual_stages} virtual = {p * pc.virtual_stages} chunks of "
          f"{cfg.model.n_layers // (p * pc.virtual_stages)} layer(s), {cfg.train.microbatches} microbatches, "
          f"{t.ticks} ticks, bubble {t.bubble():.1%} (formula {t.bubble_formula():.1%})")


def table(cfg, mesh) -> schedule_lib.Table:
  return schedule_lib.build(cfg.pipeline.schedule, stages(mesh), cfg.train.microbatches, cfg.pipeline.virtual_stages)


def links(t: schedule_lib.Table) -> list[tuple[tuple[int, int], ...]]:
  """The device pairs activations move over, one tuple of (source, target) per ppermute (a fixed offset
  mod p; (s, s) = kept on the device, zbv's turn); gradients go back over the same links reversed."""
  by_offset = {}
  for c in range(t.chunks - 1):
    a, b = t.device_of(c)[0], t.device_of(c + 1)[0]
    by_offset.setdefault((b - a) % t.p, set()).add((a, b))
  return [tuple(sorted(pairs)) for _, pairs in sorted(by_offset.items())]


def program_table(t: schedule_lib.Table) -> tuple[np.ndarray, int, int]:
  """The table as int32 (ticks, p, NCOL + 2 x links) columns, and the stash and gradient slot counts (+1 trash)."""
  p, last, F, B = t.p, t.chunks - 1, schedule_lib.F, schedule_lib.B
  stash = [schedule_lib.assign_slots(iv) for iv in t.stash_intervals()]
  grads = [schedule_lib.assign_slots(iv) for iv in t.grad_intervals()]
  S, G = max(max(n for _, n in stash), 1), max(max(n for _, n in grads), 1)
  ls = links(t)
  link = {pair: k for k, pairs in enumerate(ls) for pair in pairs}
  out = np.zeros((t.ticks, p, NCOL + 2 * len(ls)), np.int32)
  out[:, :, SLOT], out[:, :, GSLOT], out[:, :, XSLOT] = S, G, t.m
  out[:, :, NCOL:NCOL + len(ls)], out[:, :, NCOL + len(ls):] = S, G
  kinds = {F: FWD, B: BWD_X if t.split else BWD, schedule_lib.W: BWD_W}
  first = {F: FWD, B: IDLE, schedule_lib.W: BWD} if t.split else kinds  # chunk 0's W also gives its input gradient
  for tick, row in enumerate(t.grid):
    for s, op in enumerate(row):
      if op is None:
        continue
      c, r = t.chunk_of(s, op.chunk), out[tick, s]
      r[BRANCH], r[MB], r[CHUNK], r[GCHUNK] = (first if c == 0 else kinds)[op.kind], op.mb, op.chunk, c
      if c > 0:  # the chunk's stashed input (chunk 0 reads the embedded tokens)
        r[SLOT] = stash[s][0][(op.mb, c)]
      if op.kind == F and c < last:  # the activation goes to chunk c + 1's device
        d = t.device_of(c + 1)[0]
        out[tick, d, NCOL + link[(s, d)]] = stash[d][0][(op.mb, c + 1)]
      if op.kind == B and c > 0:  # the input gradient goes to chunk c - 1's device
        d = t.device_of(c - 1)[0]
        out[tick, d, NCOL + len(ls) + link[(d, s)]] = grads[d][0][(op.mb, c - 1)]
      if c == 0 and r[BRANCH] == BWD:  # its input is used for the last time: its gradient takes its slot
        r[XSLOT] = op.mb
      if op.kind != F and c < last:
        r[GSLOT] = grads[s][0][(op.mb, c)]
  return out, S, G


def reversed_rows(t: schedule_lib.Table) -> list[bool]:
  """Per local chunk j: whether devices hold global chunks in reverse (zbv's second row: 2p-1-s), else j*p + s."""
  order = np.array([[t.chunk_of(s, j) for s in range(t.p)] for j in range(t.v)])
  rev = [t.p > 1 and order[j, 0] > order[j, 1] for j in range(t.v)]
  assert all((row == j * t.p + (np.arange(t.p)[::-1] if r else np.arange(t.p))).all()
             for j, (row, r) in enumerate(zip(order, rev))), order
  return rev


def grads_fn(cfg, mesh, plan):
  """A function with `step.grads`'s contract (moe_metrics=True form) for this mesh."""
  return functools.partial(grads, cfg=cfg, mesh=mesh, plan=plan)


def eval_loss(graphdef, params, batch, microbatches: int, plan, *, cfg, mesh):
  """`step.eval_loss` through the pipeline: the schedule's chunk placement, forwards only."""
  return grads(graphdef, params, batch, microbatches, cfg=cfg, mesh=mesh, plan=plan, forward_only=True)


def grads(graphdef, params, batch, microbatches: int, loss_scale=1.0, moe_metrics: bool = False, *, cfg, mesh,
          plan, forward_only: bool = False):
  """`step.grads` run as a pipeline: (loss, grads, n_valid[, moe metrics]). Backwards are seeded with
  loss_scale / n_valid; each layer's aux loss enters with loss_scale / (microbatches * MoE layers).
  `forward_only`: `step.eval_loss`'s {loss, loss_sum, tokens} from the forwards alone."""
  p, v, m = stages(mesh), cfg.pipeline.virtual_stages, microbatches
  mc = cfg.model
  n_moe = mc.n_layers if mc.moe_experts else 0
  t = (schedule_lib.build_forward if forward_only else schedule_lib.build)(cfg.pipeline.schedule, p, m, v)
  prog, S, G = program_table(t)
  # Only the branches this table uses are compiled (a table may have no idle tick).
  used = sorted(set(prog[..., BRANCH].flat))
  prog[..., BRANCH] = np.searchsorted(used, prog[..., BRANCH])
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  denom = jnp.maximum(n_valid, 1).astype(jnp.float32)
  mbs = placement_lib.split_microbatches(batch, m, plan)
  # (layers, ...) -> (v, p, layers per chunk, ...): [j, s] is global chunk j*p + s (zbv: 2p-1-s on j = 1), so
  # device s gets its v chunks. For v = 1 this matches the stored split (no traffic);
  # for v > 1 XLA moves the layers between devices (an all-to-all each way).
  lc = mc.n_layers // (p * v)
  rev = reversed_rows(t)
  # (a permute over `pipeline` for a reversed row: a gather by chunk index would all-reduce whole layer stacks)
  flip = lambda x: jnp.stack([x[j, ::-1] if r else x[j] for j, r in enumerate(rev)]) if any(rev) else x  # noqa: E731
  layers = jax.tree.map(lambda a: flip(a.reshape(v, p, lc, *a.shape[1:])), params["layers"])
  rest = {k: x for k, x in params.items() if k != "layers"}
  state = nnx.state(nnx.merge(graphdef, params))  # the layers' logical axes, in `params`' leaf order
  axes = jax.tree.unflatten(jax.tree.structure(params["layers"]), [x.get_metadata()["axes"] for x in jax.tree.leaves(
      state["layers"], is_leaf=lambda x: isinstance(x, nnx.Variable))])
  # The tokens are embedded here, from the table as stored; inside the region XLA would gather the whole float32
  # table for every op of chunk 0, and build its whole gradient (llama3.1-70b: 3.9 GiB each). Chunk 0's backward
  # puts its input gradient in its input's slot (+1 discard slot), and the table's gradient is this lookup's vjp.
  dt = jnp.dtype(mc.dtype)

  def embed(e):  # rows as the table's (d_model split) until cast: XLA would move them to the batch split in float32
    rows = plan.constrain(jnp.take(e, mbs["inputs"], axis=0), (None, None, None, "embed"))
    return plan.constrain(rows.astype(dt), (None, *ACT))
  x0, embed_vjp = jax.vjp(embed, params["embed"])
  x0 = plan.constrain(jnp.concatenate([x0, jnp.zeros_like(x0[:1])]), (None, *ACT))
  head = [k for k in rest if k != "embed" or mc.tie_embeddings]  # what the last chunk differentiates
  body = functools.partial(_run, graphdef, mc, plan, jnp.asarray(prog), used, links(t), S, G, p, v, m, n_moe, dt,
                           axes, head)
  out = sharding.manual(body, mesh, (P(None, AXIS), P(), P(), P(), P(), P()),
                        (P(None, AXIS), P(), P(), P(), P(None, AXIS), P()),
                        axis_names={AXIS})(layers, rest, mbs, x0, denom, jnp.asarray(loss_scale, jnp.float32))
  g_layers, g_rest, loss_sum, moe, load, g_x0 = out
  if forward_only:
    return {"loss": loss_sum / denom, "loss_sum": loss_sum, "tokens": n_valid}
  g_embed = embed_vjp(g_x0[:m].astype(dt))[0]
  g_rest["embed"] = g_rest["embed"] + g_embed if mc.tie_embeddings else g_embed
  g = {**g_rest, "layers": jax.tree.map(lambda a: flip(a).reshape(mc.n_layers, *a.shape[3:]), g_layers)}
  g = {k: g[k] for k in params}  # the params' key order
  res = loss_sum / denom, jax.tree.map(lambda x: x / loss_scale, g), n_valid
  if not moe_metrics:
    return res
  moe["aux"] = moe["aux"] / max(n_moe, 1)  # summed over layers; step's totals hold the mean over layers
  moe["load"] = flip(load).reshape(mc.n_layers, -1)[:n_moe]  # (v, p, layers per chunk, X): global order
  return *res, moe_balance.update_metrics(moe, m)


@dataclasses.dataclass(frozen=True, eq=False)
class StagePlan(plan_lib.Plan):
  """The plan inside the pipeline region. cuDNN attention's custom partitioning cannot read a partially
  manual region's shardings (jax 0.10.2: "'GSPMDSharding' object has no attribute 'spec'"), so there it
  runs in a nested shard_map, manual over the other axes too: attention is local to its rows and heads."""

  def attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL):
    if self.attention != "cudnn":
      return super().attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)
    q, kv = (self.spec(("batch", "length", h, None), x.shape) for h, x in (("act_heads", q_BxLxHxE),
                                                                             ("act_kv_heads", k_BxLxKxE)))
    rest = {a for a in self.mesh.axis_names if a != AXIS}
    return sharding.manual(super().attend, self.mesh, (q, kv, kv, self.spec(("batch", "length"), seg_BxL.shape)), q,
                           axis_names=rest)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)


def _run(graphdef, mc, plan, prog, used, links, S, G, p, v, m, n_moe, dt, axes, head, layers, rest, mbs, x0, denom,
         scale):
  """The per-device program: scan over ticks, switch on this device's table entry."""
  fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
  plan = StagePlan(**{**fields, "mesh": jax.sharding.get_abstract_mesh()})  # the mesh seen inside
  s = jax.lax.axis_index(AXIS)
  layers = jax.tree.map(lambda a: a[:, 0], layers)  # (v, layers per chunk, ...)
  b, L = mbs["inputs"].shape[1:]
  D = mc.d_model
  act = lambda x: plan.constrain(x, ACT)  # noqa: E731
  aux_ct = scale / (m * max(n_moe, 1))  # d objective / d (one layer's aux loss of one microbatch)
  use_remat, policy = model_lib.remat_policy(mc.remat)

  block_of = lambda block, x, tables, seg: block(x, tables, seg, plan)  # noqa: E731
  run_block = nnx.remat(block_of, policy=policy, prevent_cse=False) if use_remat else block_of
  module = lambda rest, chunk: nnx.merge(graphdef, {**rest, "layers": chunk})  # noqa: E731

  def stage(chunk, x, mb):
    """One chunk's layers: output, MoE totals (summed aux, dropped, assigned), load (layers, X)."""
    # the chunk's weights as stored (split over fsdp), so that their gradient is too: unconstrained, the
    # backward of the layers' scan all-reduces each layer's weight gradient and stacks the chunk's whole
    chunk = jax.tree.map(lambda a, ax: plan.constrain(a, (None, *ax[1:])), chunk, axes)
    model = module(rest, chunk)
    tables = model_lib.rope_tables(mb["positions"], mc)
    y, stats = model_lib._scan_blocks(run_block, model.layers, x, tables, mb["segment_ids"])
    tot = {k: sum((st[k] for st in stats), jnp.float32(0)) for k in ("dropped", "assigned")}
    tot["aux"] = sum((moe_balance.aux_loss(mc, [st]) for st in stats), jnp.float32(0))  # jaxtrain convention
    load = jnp.stack([st["load"] for st in stats]) if stats else zeros_load[0]
    return act(y), tot, load

  def head_loss(rest_p, y, mb):
    model = module(rest_p, jax.tree.map(lambda a: a[0], layers))
    return xent.nll_sum(model.final_norm(y), model.head_weight(), mb["targets"], mb["loss_mask"], plan,
                        plan.loss_chunk_tokens, gather=False)

  zero_act = act(jnp.zeros((b, L, D), dt))
  zeros_load = jnp.zeros((v, jax.tree.leaves(layers)[0].shape[1], max(mc.moe_experts, 1)), jnp.float32)
  f32 = jnp.float32(0)

  def result(acc, y=zero_act, dx=zero_act, loss=f32, tot=None, load=None):
    tot = tot or {"aux": f32, "dropped": f32, "assigned": f32}
    load = zeros_load[0] if load is None else load
    return {"y": y, "dx": dx, "acc": acc, "loss": loss, "moe": tot, "load": load}

  def add(acc, j, g_chunk, g_rest):
    """The float32 accumulators (layers, rest) plus local chunk j's gradients, inside the branch: the
    switch then returns the accumulators (aliased in place), not gradient-sized values from every branch."""
    acc_layers, acc_rest = acc
    return (jax.tree.map(lambda a, g: a.at[j].add(g.astype(jnp.float32)), acc_layers, g_chunk),
            jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_rest, g_rest))

  # Branches: (accumulators, local chunk index, chunk params, chunk input, output gradient, microbatch, last);
  # the model's last chunk runs head and loss (a lax.cond: one copy of the layers).
  def forward(acc, j, chunk, x, dy, mb, last):
    y, tot, load = stage(chunk, x, mb)
    loss = jax.lax.cond(last, lambda: head_loss(rest, y, mb), lambda: f32)
    return result(acc, y=y, loss=loss, tot=tot, load=load)

  def loss_of(dy, mb, last):
    """The chunk's share of the objective as a function of (chunk params, head params, chunk input)."""
    def objective(c, h, x):
      y, tot, _ = stage(c, x, mb)
      # last chunk: the scaled loss; else <y, dy>, whose gradient is the vjp with dy
      out = jax.lax.cond(last, lambda: head_loss({**rest, **h}, y, mb) * (scale / denom),
                         lambda: jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)))
      return out + tot["aux"] * aux_ct
    return objective

  heads = {k: rest[k] for k in head}

  def backward(acc, j, chunk, x, dy, mb, last):
    g_chunk, g_head, dx = jax.grad(loss_of(dy, mb, last), argnums=(0, 1, 2))(chunk, heads, x)
    return result(add(acc, j, g_chunk, g_head), dx=act(dx.astype(dt)))

  # Split backward (zero-bubble schedules): B and W each recompute the chunk's forward from the stashed
  # input; B differentiates w.r.t. the input only (no weight-gradient matmuls), W w.r.t. the weights only
  # (it redoes the activation gradients inside the chunk, which the weights' need).
  def backward_x(acc, j, chunk, x, dy, mb, last):
    return result(acc, dx=act(jax.grad(loss_of(dy, mb, last), argnums=2)(chunk, heads, x).astype(dt)))

  def backward_w(acc, j, chunk, x, dy, mb, last):
    return result(add(acc, j, *jax.grad(loss_of(dy, mb, last), argnums=(0, 1))(chunk, heads, x)))

  branches = [(lambda acc, *_: result(acc), forward, backward, backward_x, backward_w)[k] for k in used]

  def tick(carry, row_PxK):
    stash, gbuf, x0, acc_layers, acc_rest, loss, tot, acc_load = carry
    r = row_PxK[s]
    mb = jax.tree.map(lambda a: a[r[MB]], mbs)
    chunk = jax.tree.map(lambda a: a[r[CHUNK]], layers)
    c = r[GCHUNK]
    x = jnp.where(c == 0, x0[r[MB]], stash[r[SLOT]])  # chunk 0: the embedded tokens
    out = jax.lax.switch(r[BRANCH], branches, (acc_layers, acc_rest), r[CHUNK], chunk, x, gbuf[r[GSLOT]], mb,
                         c == p * v - 1)
    x0 = x0.at[r[XSLOT]].set(out["dx"])  # chunk 0's input gradient (else into the discard slot)
    acc_layers, acc_rest = out["acc"]
    tot = jax.tree.map(jnp.add, tot, out["moe"])
    acc_load = acc_load.at[r[CHUNK]].add(out["load"])  # forwards only (the other branches give zeros)
    for k, pairs in enumerate(links):  # (s, s): zbv's turn stays on the device
      same = pairs[0][0] == pairs[0][1]
      stash = stash.at[r[NCOL + k]].set(out["y"] if same else jax.lax.ppermute(out["y"], AXIS, pairs))
      back = [(b, a) for a, b in pairs]
      gbuf = gbuf.at[r[NCOL + len(links) + k]].set(out["dx"] if same else jax.lax.ppermute(out["dx"], AXIS, back))
    return (stash, gbuf, x0, acc_layers, acc_rest, loss + out["loss"], tot, acc_load), None

  buf = lambda n: plan.constrain(jnp.zeros((n + 1, b, L, D), dt), (None, *ACT))  # noqa: E731
  carry = (buf(S), buf(G), x0, jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), layers),
           jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), heads), f32,
           {"aux": f32, "dropped": f32, "assigned": f32}, zeros_load)
  (_, _, g_x0, acc_layers, acc_rest, loss, tot, acc_load), _ = jax.lax.scan(tick, carry, prog)
  # chunk gradients stay on their device; the head's and chunk 0's input gradients (device 0's) are summed over it
  # (in float32: exact, as the others are zeros; a bfloat16 all-reduce here crashes XLA:CPU, jax 0.10.2)
  g_x0 = jnp.where(s == 0, g_x0, jnp.zeros((), dt)).astype(jnp.float32)
  acc_rest, loss, tot, g_x0 = jax.lax.psum((acc_rest, loss, tot, g_x0), AXIS)
  return jax.tree.map(lambda a: a[:, None], acc_layers), acc_rest, loss, tot, acc_load[:, None], g_x0


def act_bytes(cfg, mesh) -> int:
  """Bytes of one chunk input on one device (a microbatch's tokens x d_model, compute dtype)."""
  return sharding.tokens_per_device(cfg, mesh) * cfg.model.d_model * np.dtype(cfg.model.dtype).itemsize


def traffic(cfg, mesh, rows) -> dict[str, int]:
  """Bytes per device per step over `pipeline`: ppermutes, the rest's gradient all-reduce, the v > 1 restack."""
  p, t, act = stages(mesh), table(cfg, mesh), act_bytes(cfg, mesh)
  sends = 2 * sum(pairs[0][0] != pairs[0][1] for pairs in links(t))  # activations and gradients per link
  useful = sum(op is not None and ((op.kind == schedule_lib.F and t.chunk_of(s, op.chunk) < t.chunks - 1)
                                   or (op.kind == schedule_lib.B and t.chunk_of(s, op.chunk) > 0))
               for row in t.grid for s, op in enumerate(row))
  out = {f"activations + grads, ppermute x{sends} per tick ({t.ticks} ticks; on average {useful / p:.0f} of a "
         f"device's {sends * t.ticks} sends carry data)": sends * t.ticks * act}
  ring = 2 * (p - 1) / p
  head = sum(math.prod(r.device_shape) * r.count for r in rows
             if not r.path.startswith("layers") and (r.path != "embed" or cfg.model.tie_embeddings))
  out["grad all-reduce (final norm, head; chunk 0's input gradients)"] = int(ring * (head * 4 + (t.m + 1) * act))
  if cfg.pipeline.virtual_stages > 1:
    stack = sum(math.prod(r.device_shape) * r.count for r in rows if r.path.startswith("layers"))
    out["layer stack to chunks and grads back (all-to-all)"] = int(2 * (p - 1) * stack * 4)
  return out
