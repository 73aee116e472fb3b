"""Pipeline parallelism: an executor of the gradient contract (jaxtrain.run.grads) that runs the microbatches'
forward and backward work as a static schedule says. One SPMD program, manual over `pipeline` only, scans the
schedule's ticks and runs per tick idle, forward or backward of one chunk of layers (recomputing from the stashed
input), the backward whole or split into B (input gradient; it hands each projection's input and output gradient
to W) and W (the projections' weight gradients from them, model/wgrad.py). The objective, its weights, the
microbatches and the gradient layout are the contract's; only the order of the work is the pipeline's."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core.errors import UserError
from jaxtrain.model import loss as xent, moe_balance, mtp as mtp_lib, ops, roles, transformer as model_lib, wgrad
from jaxtrain.model.layers import rope_tables
from jaxtrain.parallel import fp8, schedule as schedule_lib, sharding
from jaxtrain.parallel.program import (
    BRANCH, BWD, BWD_W, BWD_X, CHUNK, ESLOT, FCHUNK, FGCHUNK, FMB, FSLOT, FWD, GCHUNK, GSLOT, IDLE, MB, NCOL, PAIRED,
    SLOT, WSLOT, XSLOT, links, paired, program_table, reversed_rows)

AXIS = "pipeline"
ACT = ("batch", "act_length", "act_embed")  # a chunk's input/output activation


def stages(mesh) -> int:
  return mesh.shape.get(AXIS, 1)


def active(mesh) -> bool:
  return stages(mesh) > 1


def chunk_windows(m, lc: int) -> tuple[int, ...]:
  """The windows of a chunk's `lc` layers: every chunk's are the first chunk's (`check`)."""
  return m.layer_windows()[:lc]


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
  lc, windows = m.n_layers // (p * pc.virtual_stages), m.layer_windows()
  if any(windows[i] != windows[i % lc] for i in range(m.n_layers)):
    raise UserError(f"model.layer_types={m.layer_types!r} gives the pipeline's chunks of {lc} layer(s) different "
                    f"windows; a pattern that repeats every {lc} layers (or fewer, dividing it) runs on pipeline={p}")
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


def switch_indices(prog) -> list[int]:
  """The branch kinds the table uses, in kind order (only those are compiled: the tick switch's branches); the
  table's BRANCH column becomes the index of its kind among them, the switch's index."""
  used = sorted(set(prog[..., BRANCH].flat))
  prog[..., BRANCH] = np.searchsorted(used, prog[..., BRANCH])
  return used


def tick_table(cfg, mesh) -> dict:
  """What the overlap report needs to count the training step's ticks as they run (empty without a pipeline):
  `ticks`, (ticks, stages) the branch of the tick switch each device runs, and `last`, whether that cell's ops run
  the model's last chunk (its head terms): 1 all of them, 0 none, -1 a pair of both."""
  if not active(mesh):
    return {}
  t = table(cfg, mesh)
  prog = program_table(t)[0]
  switch_indices(prog)
  last = np.zeros(prog.shape[:2], np.int32)
  for tick, row in enumerate(t.grid):
    for s, cell in enumerate(row):
      flags = {t.chunk_of(s, op.chunk) == t.chunks - 1 for op in schedule_lib.ops_of(cell)}
      last[tick, s] = -1 if len(flags) > 1 else int(flags == {True})
  return {"ticks": prog[..., BRANCH], "last": last}


def executor(cfg, mesh):
  """The gradient contract's executor for this mesh: (token loss sum, scaled gradient sum, MoE totals)."""
  return functools.partial(_execute, cfg=cfg, mesh=mesh)


def forward_executor(cfg, mesh):
  """The evaluation executor: the microbatches' summed token loss, forwards only, chunks placed as in training."""
  def run(objective, params, mbs):
    return _execute(objective, params, mbs, None, None, cfg=cfg, mesh=mesh, forward_only=True)[0]
  return run


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """What the program inside the region knows at trace time."""
  objective: Any
  plan: Any
  prog: Any  # the table, (ticks, p, columns) int32
  used: list  # branch kinds the table uses
  paired: bool  # some tick pairs a forward with another microbatch's backward op (read from their own columns)
  links: list
  S: int  # stash slots
  G: int  # gradient slots
  WN: int  # slots of what B leaves for W
  deferred: tuple  # per leaf of a chunk's parameters (jax.tree order): W makes its gradient (roles.Role.deferred)
  n_in: tuple  # per leaf: a deferred projection's input dimensions
  fp8: str  # model.fp8: W's products take FP8 operands as the projection's backward would
  p: int
  v: int
  m: int
  dt: Any
  axes: Any  # each parameter's logical axes (a layer weight's leading `layers` included)
  head: list  # the non-layer parameters the last chunk differentiates (roles: head)
  grad_specs: Any  # (layers, rest) PartitionSpecs of the gradients' layout (ZeRO), or None
  forward_only: bool
  mtp: bool  # the MTP module trains: its target embeddings come in like the tokens', their gradient goes out
  last_device: int  # the device of the model's last chunk


def _execute(objective, params, mbs, w, grad_sharding, *, cfg, mesh, forward_only=False):
  plan, mc = ops.current(), cfg.model
  p, v, m = stages(mesh), cfg.pipeline.virtual_stages, mbs["inputs"].shape[0]
  t = (schedule_lib.build_forward if forward_only else schedule_lib.build)(cfg.pipeline.schedule, p, m, v)
  prog, S, G, WN = program_table(t)
  used = switch_indices(prog)
  # (layers, ...) -> (v, p, layers per chunk, ...): [j, s] is global chunk j*p + s (zbv: 2p-1-s on j = 1), so
  # device s gets its v chunks. For v = 1 this matches the stored split (no traffic); for v > 1 XLA moves the
  # layers between devices (an all-to-all each way). A reversed row is a permute over `pipeline` (a gather by
  # chunk index would all-reduce whole layer stacks).
  lc, rev = mc.n_layers // (p * v), reversed_rows(t)
  flip = lambda x: jnp.stack([x[j, ::-1] if r else x[j] for j, r in enumerate(rev)]) if any(rev) else x  # noqa: E731
  layers = jax.tree.map(lambda a: flip(a.reshape(v, p, lc, *a.shape[1:])), params["layers"])
  rest = {k: x for k, x in params.items() if k != "layers"}
  state = nnx.state(objective.model(params))  # every parameter's logical axes, in `params`' leaf order
  axes = jax.tree.unflatten(jax.tree.structure(params), [x.get_metadata()["axes"] for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))])
  mtp = mtp_lib.trains(mc) and not forward_only
  tokens = (mbs["inputs"], mbs["targets"]) if mtp else (mbs["inputs"],)
  embedded, embed_vjp = jax.vjp(lambda e: [model_lib.scale_embeddings(_embed(plan, e, x, jnp.dtype(mc.dtype)), mc)
                                           for x in tokens], params["embed"])
  head = [k for k in rest if all(r.head for r in jax.tree.leaves(roles.tree(mc, {k: rest[k]})))]
  specs = None if grad_sharding is None else jax.tree.map(lambda sh: sh.spec, (
      grad_sharding["layers"], {k: grad_sharding[k] for k in head}))
  layer_roles = jax.tree.leaves(roles.tree(mc, {"layers": params["layers"]}))
  deferred = tuple(t.split and r.deferred for r in layer_roles)
  static = _Static(objective, plan, jnp.asarray(prog), used, paired(t), links(t), S, G, WN, deferred,
                   tuple(r.n_in for r in layer_roles), mc.fp8, p, v, m, jnp.dtype(mc.dtype), axes, head, specs,
                   forward_only, mtp, t.device_of(t.chunks - 1)[0])
  w = w if w is not None else jnp.float32(0)  # evaluation: no objective weights
  slots = [plan.constrain(jnp.concatenate([x, jnp.zeros_like(x[:1])]), (None, *ACT)) for x in embedded]  # +discard
  # plan.mesh: the abstract mesh inside a region already manual over data (data_region), else `mesh`
  out = sharding.manual(functools.partial(_region, static), plan.mesh, (P(None, AXIS), P(), P(), P(), P()),
                        (P(None, AXIS), P(), P(), P(), P(None, AXIS), P(), P()), axis_names={AXIS})(
      layers, rest, mbs, slots, w)
  g_layers, g_rest, loss_sum, moe, load, head_load, g_slots = out
  if forward_only:
    return loss_sum, None, None
  g_embed = embed_vjp([g[:m].astype(jnp.dtype(mc.dtype)) for g in g_slots])[0].astype(jnp.float32)
  g_rest = {**{k: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), x) for k, x in rest.items()}, **g_rest}
  g_rest["embed"] = g_rest["embed"] + g_embed
  g = {**g_rest, "layers": jax.tree.map(lambda a: flip(a).reshape(mc.n_layers, *a.shape[3:]), g_layers)}
  g = {k: g[k] for k in params}  # the params' key order
  g = g if grad_sharding is None else jax.lax.with_sharding_constraint(g, grad_sharding)
  rows = [flip(load).reshape(mc.n_layers, -1)[:len(moe_balance.moe_layers(mc))]]  # (v, p, lc, X): global order
  moe["load"] = jnp.concatenate(rows + ([head_load[None]] if moe_balance.mtp_is_moe(mc) else []))
  return loss_sum, g, moe


def _embed(plan, e, tokens, dt):
  """The tokens of every microbatch embedded before the region, from the table as stored: inside, XLA would gather
  the whole float32 table for every op of chunk 0, and build its whole gradient (llama3.1-70b: 3.9 GiB each).
  Rows stay split like the table's d_model until cast: XLA would move them to the batch split in float32. They
  reach the activations' split by a local slice, then one all-to-all (sharding.slices_first); the ids come split
  like that slice's rows (split over the table's own axes too, XLA's gather replicated its output whole)."""
  table_axes, shape = (None, None, None, "embed"), (*tokens.shape, e.shape[-1])
  stored = plan.spec(table_axes, shape)
  step = sharding.slices_first(stored, plan.spec((None, *ACT), shape))
  hop = step != stored  # else one all-to-all (or nothing) reaches the activations' split: as it was
  if hop:
    tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(plan.mesh, P(*step[:tokens.ndim])))
  rows = plan.constrain(plan.lookup(e, tokens), table_axes).astype(dt)
  if hop:
    rows = jax.lax.with_sharding_constraint(rows, NamedSharding(plan.mesh, step))
  return plan.constrain(rows, (None, *ACT))


# The per-tick buffers (stash, gradient and W slots, the embedded tokens) hold a 16-bit float's bits as uint16 and
# are written and read as dynamic slices: XLA:CPU updates a bfloat16 buffer in float32, converting the whole buffer
# both ways at every tick (`.at[i].set`, a scatter, adds a select); bits are moved as they are.
def bits(dtype):
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.uint16) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 else dtype


def as_bits(x):
  return jax.lax.bitcast_convert_type(x, bits(x.dtype)) if bits(x.dtype) != x.dtype else x


def put(buf, value, i):
  return jax.lax.dynamic_update_index_in_dim(buf, as_bits(value), i, 0)


def get(buf, i, dtype):
  x = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


class Part(NamedTuple):
  """One op's inputs in a tick: local chunk index, the chunk's parameters, its input (stashed, or the embedded
  tokens), the MTP module's target embeddings (or None), the microbatch, whether it is the model's last chunk."""
  j: Any
  chunk: Any
  x: Any
  e: Any
  mb: Any
  last: Any


def _region(static: _Static, layers, rest, mbs, slots, w):
  """The per-device program: the tick scan under the plan as seen inside the region. `slots`: the embedded tokens
  (and the MTP module's embedded targets), m + 1 slots each (the last one a discard)."""
  plan = dataclasses.replace(static.plan, mesh=jax.sharding.get_abstract_mesh())
  with ops.use(plan):
    return _Ticks(static, plan, layers, rest, mbs, w).run(slots)


class _Ticks:
  """The branches of one tick (idle, forward, backward or its B and W halves) on this device's chunks."""

  def __init__(self, static: _Static, plan, layers, rest, mbs, w):
    self.st, self.plan, self.rest, self.mbs, self.w = static, plan, rest, mbs, w
    self.layers = jax.tree.map(lambda a: a[:, 0], layers)  # (v, layers per chunk, ...)
    self.s = jax.lax.axis_index(AXIS)
    b, L = mbs["inputs"].shape[1:]
    D, X = static.objective.cfg.model.d_model, max(static.objective.cfg.model.moe_experts, 1)
    self.zero_act = self.act(jnp.zeros((b, L, D), static.dt))
    self.zeros_load = jnp.zeros((jax.tree.leaves(self.layers)[0].shape[1], X), jnp.float32)
    self.zero_head_load = jnp.zeros((X,), jnp.float32)
    # the head's weights as stored too, like a chunk's
    self.heads = {k: jax.tree.map(lambda a, ax: plan.constrain(a, ax), rest[k], static.axes[k]) for k in static.head}
    self.tokens = (b, L)
    self.layer_axes = jax.tree.leaves(static.axes["layers"], is_leaf=lambda x: isinstance(x, tuple))
    chunk0 = jax.tree.map(lambda a: a[0], self.layers)
    # one pass's (input, output gradient) zeros of each deferred projection: B's probes, W's operands
    self.zero_kept = wgrad.zero_probes(chunk0, static.deferred, static.n_in, self.tokens, 1, static.dt)
    # Without other mesh axes no branch holds a collective: each device can take its own on CPU too
    self.own_branch = plan.platform != "cpu" or all(n == AXIS or k == 1 for n, k in plan.mesh.shape.items())

  def act(self, x):
    return self.plan.constrain(x, ACT)

  # The stages take different branches at the same tick. XLA:CPU runs a collective only when every device joins
  # (the collective-permutes with which XLA splits a stage's work between its axes too), so on CPU with another
  # mesh axis every device computes every branch and selects its own: the same values, some times the work.
  # Elsewhere (and on CPU with `pipeline` the only axis: no collective in a branch), lax.switch/cond.
  def run_op(self, index, *args):
    """The tick's op (branch `index` of the table's used kinds). Where every device computes every branch (CPU
    with another mesh axis), a pair's forward and backward are the lone ones' outputs merged, not computed again."""
    if self.own_branch:
      return jax.lax.switch(index, self.branches(), *args)
    back_of = {k: b for b, k in PAIRED.items()}
    needed = {j for k in self.st.used for j in ((FWD, back_of[k]) if k in back_of else (k,))}
    base = {k: self.own()[k](*args) for k in sorted(needed)}
    outs = [merged(base[FWD], base[back_of[k]]) if k in back_of else base[k] for k in self.st.used]
    return jax.tree.map(lambda *xs: jax.lax.select_n(index, *xs), *outs)

  def cond(self, pred, true_fn, false_fn):
    if self.own_branch:
      return jax.lax.cond(pred, true_fn, false_fn)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(), false_fn())

  def pin(self, g, spec):
    return g if spec is None else jax.lax.with_sharding_constraint(g, NamedSharding(self.plan.mesh, spec))

  def keep(self, g_chunks, g_head, lead: int = 1):
    """Chunk and head gradients in the gradients' layout (ZeRO-2: split over data too) where it is pinned; `lead`:
    the dimensions before a layer's own (a chunk's layers; the accumulator's chunks too)."""
    if self.st.grad_specs is None:
      return g_chunks, g_head
    specs_l, specs_h = self.st.grad_specs
    return (jax.tree.map(lambda g, sp: self.pin(g, P(*(None,) * lead, *sp[1:])), g_chunks, specs_l),
            jax.tree.map(self.pin, g_head, specs_h))

  def deferred(self) -> list[int]:
    return [i for i, d in enumerate(self.st.deferred) if d]

  def stage(self, chunk, x, mb, probes=None):
    """One chunk's layers: output, its MoE stats (list per layer). `probes`: B's zero probes (px, pdy) of the
    deferred projections, which then hand their inputs and output gradients to them (wgrad.Tapped)."""
    mc = self.st.objective.cfg.model
    # the chunk's weights as stored (split over fsdp), so that their gradient is too: unconstrained, the
    # backward of the layers' scan all-reduces each layer's weight gradient and stacks the chunk's whole
    chunk = jax.tree.map(lambda a, ax: self.plan.constrain(a, (None, *ax[1:])), chunk, self.st.axes["layers"])
    chunk = chunk if probes is None else wgrad.wrap(chunk, self.st.deferred, probes)
    model = self.st.objective.model({**self.rest, "layers": chunk})
    y, stats = model_lib.run_stack(model.layers, x, rope_tables(mb["positions"], mc), mb["segment_ids"], mc.remat,
                                   windows=chunk_windows(mc, jax.tree.leaves(chunk)[0].shape[0]))
    return self.act(y), stats

  def head_terms(self, head_params, y, e, mb):
    """(objective of the terms after the last block, token loss sum, the MTP block's MoE stats); `e`: the MTP
    module's target embeddings (None without MTP)."""
    obj = self.st.objective
    model = obj.model({**self.rest, **head_params, "layers": jax.tree.map(lambda a: a[0], self.layers)})
    out, ce, stats = obj.head(model, model.final_norm(y), mb, self.w, gather=False, next_emb_BxLxD=e)
    return out + obj.aux(stats, self.w), ce, stats

  def head_loss(self, y, mb):
    """The token loss sum alone (evaluation)."""
    obj = self.st.objective
    model = obj.model({**self.rest, "layers": jax.tree.map(lambda a: a[0], self.layers)})
    c = obj.cfg
    return xent.nll_sum(model.final_norm(y), model.head_weight(), mb["targets"], mb["loss_mask"],
                        c.train.loss_chunk_tokens, c.model.head_logits_dtype, gather=False)

  def result(self, acc, y=None, dx=None, loss=0.0, moe=None, load=None, head_load=None, de=None, kept=None):
    f32 = jnp.float32
    moe = moe or {"aux": f32(0), "dropped": f32(0), "assigned": f32(0)}
    kept = kept if kept is not None else [(jnp.zeros_like(a), jnp.zeros_like(b)) for a, b in self.zero_kept]
    return {"y": self.zero_act if y is None else y, "dx": self.zero_act if dx is None else dx, "acc": acc,
            "kept": kept,
            "de": self.zero_act if de is None else self.act(de.astype(self.st.dt)),
            "loss": f32(loss), "moe": moe, "load": self.zeros_load if load is None else load,
            "head_load": self.zero_head_load if head_load is None else head_load}

  def add(self, acc, j, g_chunk: dict, g_head=None):
    """The float32 accumulators (layers, head) plus local chunk j's gradients ({leaf index: gradient}, some of the
    chunk's leaves), inside the branch: the switch then returns the accumulators (aliased in place), not
    gradient-sized values from every branch."""
    acc_layers, acc_head = acc
    flat, tdef = jax.tree.flatten(acc_layers)
    specs = [None] * len(flat) if self.st.grad_specs is None else [
        P(None, *sp[1:]) for sp in jax.tree.leaves(self.st.grad_specs[0], is_leaf=lambda x: isinstance(x, P))]
    for i, g in g_chunk.items():
      flat[i] = flat[i].at[j].add(self.pin(g, specs[i]).astype(jnp.float32))
    if g_head is not None:
      if self.st.grad_specs is not None:
        g_head = jax.tree.map(self.pin, g_head, self.st.grad_specs[1])
      acc_head = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_head, g_head)
    return tdef.unflatten(flat), acc_head

  def totals(self, stats):
    """A chunk's (or the head's) MoE totals: its share of the aux loss, dropped and assigned, load rows."""
    tot = {"aux": self.st.objective.aux_share(stats) if stats else jnp.float32(0),
           **{k: sum((s[k] for s in stats), jnp.float32(0)) for k in ("dropped", "assigned")}}
    return tot, jnp.stack([s["load"] for s in stats]) if stats else None

  # Branches: (accumulators, the forward's `Part`, the backward op's, the output gradient, (W slots, this pass's));
  # the model's last chunk runs the head terms (a lax.cond: one copy of the layers).
  def idle(self, acc, *_):
    return self.result(acc)

  def forward(self, acc, fwd, *_):
    _, chunk, x, e, mb, last = fwd
    y, stats = self.stage(chunk, x, mb)
    tot, load = self.totals(stats)
    if self.st.forward_only:
      return self.result(acc, y=y, loss=self.cond(last, lambda: self.head_loss(y, mb), lambda: jnp.float32(0)))

    def head():
      _, ce, head_stats = self.head_terms(self.heads, y, e, mb)
      h_tot, h_load = self.totals(head_stats)
      return ce, h_tot, self.zero_head_load if h_load is None else h_load[0]
    zero = (jnp.float32(0), jax.tree.map(jnp.zeros_like, tot), self.zero_head_load)
    ce, h_tot, h_load = self.cond(last, head, lambda: zero)
    return self.result(acc, y=y, loss=ce, moe=jax.tree.map(jnp.add, tot, h_tot), load=load, head_load=h_load)

  def objective_of(self, dy, mb, last):
    """The chunk's share of the objective as a function of (chunk params, head params, chunk input, MTP target
    embeddings, B's probes)."""
    def objective(c, h, x, e, probes=None):
      y, stats = self.stage(c, x, mb, probes)
      # last chunk: the head terms; else <y, dy>, whose gradient is the vjp with dy
      out = self.cond(last, lambda: self.head_terms(h, y, e, mb)[0],
                         lambda: jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)))
      return out + self.st.objective.aux(stats, self.w)
    return objective

  def backward(self, acc, fwd, bwd, dy, waiting):
    j, chunk, x, e, mb, last = bwd
    g_chunk, g_head, dx, de = jax.grad(self.objective_of(dy, mb, last), argnums=(0, 1, 2, 3))(
        chunk, self.heads, x, e)
    return self.result(self.add(acc, j, dict(enumerate(jax.tree.leaves(g_chunk))), g_head),
                       dx=self.act(dx.astype(self.st.dt)), de=de)

  # Split backward (zero-bubble schedules). B recomputes the chunk's forward from the stashed input and
  # differentiates it w.r.t. the input, the head and the parameters that are not deferred projections (norms,
  # router, experts); each deferred projection hands its input x and output gradient dy to B's probes, kept in a
  # W slot. W is only the deferred projections' x^T dy: no forward, no activation gradient again.
  def backward_x(self, acc, fwd, bwd, dy, waiting):
    j, chunk, x, e, mb, last = bwd
    g_free, (g_head, dx, de), got = wgrad.split_grad(self.objective_of(dy, mb, last), chunk, self.st.deferred,
                                                     self.zero_kept, self.heads, x, e, argnums=(0, 1, 2))
    return self.result(self.add(acc, j, g_free, g_head), dx=self.act(dx.astype(self.st.dt)), de=de, kept=got)

  def backward_w(self, acc, fwd, bwd, dy, waiting):
    g, j = {}, bwd.j
    wait, ws = waiting  # the W slots, and this pass's
    for i, (a, b) in zip(self.deferred(), wait):
      px, pdy = get(a, ws, self.st.dt), get(b, ws, self.st.dt)
      if self.st.fp8 != "none":  # the operands the FP8 projection's weight gradient has, per layer's tensors
        px, pdy = jax.vmap(lambda a: fp8.qdq(a, fp8.E4M3))(px), jax.vmap(lambda a: fp8.qdq(a, fp8.E5M2))(pdy)
      # in the weight's stored split, as the recomputing backward's (unconstrained: all-reduced whole over fsdp)
      g[i] = self.plan.constrain(wgrad.weight_grad(px, pdy, lead=1), (None, *self.layer_axes[i][1:]))
    return self.result(self.add(acc, j, g))

  def paired(self, back):
    """A forward and another microbatch's backward op in one tick (dualpipev): neither reads the other's values,
    so XLA may overlap one's communication (the MoE all-to-alls, the sends) with the other's compute."""
    return lambda acc, fwd, bwd, dy, waiting: merged(self.forward(acc, fwd), back(acc, fwd, bwd, dy, waiting))

  def own(self) -> dict:
    """The ops a device runs alone, by branch kind."""
    return {IDLE: self.idle, FWD: self.forward, BWD: self.backward, BWD_X: self.backward_x, BWD_W: self.backward_w}

  def branches(self) -> list:
    own = self.own()
    own.update({k: self.paired(own[b]) for b, k in PAIRED.items()})
    return [own[k] for k in self.st.used]

  def part(self, r, slots, stash, cols) -> Part:
    """The inputs of the op described by columns `cols` (MB, CHUNK, GCHUNK, SLOT or the forward's)."""
    st, (mbc, jc, cc, sc) = self.st, cols
    c = r[cc]
    x = jnp.where(c == 0, get(slots[0], r[mbc], st.dt), get(stash, r[sc], st.dt))  # chunk 0: the embedded tokens
    return Part(r[jc], jax.tree.map(lambda a: a[r[jc]], self.layers), x,
                get(slots[1], r[mbc], st.dt) if st.mtp else None, jax.tree.map(lambda a: a[r[mbc]], self.mbs),
                c == st.p * st.v - 1)

  def tick(self, carry, row_PxK):
    stash, gbuf, wait, slots, acc, loss, tot, acc_load, head_load = carry
    st, r = self.st, row_PxK[self.s]
    bwd = self.part(r, slots, stash, (MB, CHUNK, GCHUNK, SLOT))
    # a table without pairs writes a forward's columns into the backward's too: one read of the chunk and input
    fwd = self.part(r, slots, stash, (FMB, FCHUNK, FGCHUNK, FSLOT)) if st.paired else bwd
    dy = get(gbuf, r[GSLOT], st.dt)
    out = self.run_op(r[BRANCH], acc, fwd, bwd, dy, (wait, r[WSLOT]))
    # B's inputs and output gradients of the projections, in its W slot (the other branches: zeros, into the
    # discard slot or the slot W has just read)
    wait = [(put(a, ka, r[WSLOT]), put(b, kb, r[WSLOT])) for (a, b), (ka, kb) in zip(wait, out["kept"])]
    # the input's gradient takes the slot of chunk 0's input (else the discard slot), the MTP target embeddings'
    # that of theirs, once the last chunk's weight gradient has made it
    slots = [put(slots[0], out["dx"], r[XSLOT]), *([put(slots[1], out["de"], r[ESLOT])] if st.mtp else [])]
    tot = jax.tree.map(jnp.add, tot, out["moe"])
    acc_load = acc_load.at[r[FCHUNK]].add(out["load"])  # forwards only (the other branches give zeros)
    for k, pairs in enumerate(st.links):  # (s, s): the V's turn stays on the device
      same = pairs[0][0] == pairs[0][1]
      stash = put(stash, out["y"] if same else jax.lax.ppermute(out["y"], AXIS, pairs), r[NCOL + k])
      back = [(b, a) for a, b in pairs]
      gbuf = put(gbuf, out["dx"] if same else jax.lax.ppermute(out["dx"], AXIS, back), r[NCOL + len(st.links) + k])
    return (stash, gbuf, wait, slots, out["acc"], loss + out["loss"], tot, acc_load,
            head_load + out["head_load"]), None

  def w_slots(self) -> list:
    """(inputs, output gradients) of each deferred projection, WN + 1 slots of a chunk's layers x microbatch."""
    buf = lambda z: self.plan.constrain(  # noqa: E731
        jnp.zeros((self.st.WN + 1, *z.shape), bits(z.dtype)), (None, None, "batch", *(None,) * (z.ndim - 2)))
    return [(buf(x), buf(dy)) for x, dy in self.zero_kept]

  def run(self, slots):
    st, f32 = self.st, jnp.float32
    buf = lambda n: self.plan.constrain(  # noqa: E731
        jnp.zeros((n + 1, *self.zero_act.shape), bits(st.dt)), (None, *ACT))
    acc = self.keep(jax.tree.map(lambda a: jnp.zeros(a.shape, f32), self.layers),
                    jax.tree.map(lambda a: jnp.zeros(a.shape, f32), self.heads), lead=2)
    carry = (buf(st.S), buf(st.G), self.w_slots(), [as_bits(x) for x in slots], acc, f32(0),
             {"aux": f32(0), "dropped": f32(0), "assigned": f32(0)}, jnp.zeros((st.v, *self.zeros_load.shape), f32),
             self.zero_head_load)
    (_, _, _, g_slots, (acc_layers, acc_head), loss, tot, acc_load, head_load), _ = jax.lax.scan(
        self.tick, carry, st.prog)
    g_slots = [jax.lax.bitcast_convert_type(g, st.dt) if g.dtype != st.dt else g for g in g_slots]
    # chunk gradients stay on their device; the head's, chunk 0's input gradients (device 0's) and the MTP target
    # embeddings' (the last chunk's device) are summed over it (in float32: exact, as the others are zeros; a
    # bfloat16 all-reduce in this region aborts XLA:CPU's all-reduce promotion, jax 0.10.2)
    owner = [self.s == 0, self.s == st.last_device]
    g_slots = [jnp.where(o, g, jnp.zeros((), st.dt)).astype(f32) for o, g in zip(owner, g_slots)]
    acc_head, loss, tot, head_load, g_slots = jax.lax.psum((acc_head, loss, tot, head_load, g_slots), AXIS)
    return (jax.tree.map(lambda a: a[:, None], acc_layers), acc_head, loss, tot, acc_load[:, None], head_load,
            g_slots)


def merged(f: dict, b: dict) -> dict:
  """A pair's outputs: the backward op's, with the forward's activation, loss and MoE terms."""
  return {**b, **{k: f[k] for k in ("y", "loss", "moe", "load", "head_load")}}


def act_bytes(cfg, mesh) -> int:
  """Bytes of one chunk input on one device (a microbatch's tokens x d_model, compute dtype)."""
  return sharding.tokens_per_device(cfg, mesh) * cfg.model.d_model * np.dtype(cfg.model.dtype).itemsize


def traffic(cfg, mesh, rows) -> dict[str, int]:
  """Bytes per device per step over `pipeline`: ppermutes, the rest's gradient all-reduce, the v > 1 restack."""
  p, t, act = stages(mesh), table(cfg, mesh), act_bytes(cfg, mesh)
  sends = 2 * sum(pairs[0][0] != pairs[0][1] for pairs in links(t))  # activations and gradients per link
  useful = sum((op.kind == schedule_lib.F and t.chunk_of(s, op.chunk) < t.chunks - 1)
               or (schedule_lib.B in op.kinds() and t.chunk_of(s, op.chunk) > 0) for _, s, op in t.ops())
  out = {f"activations + grads, ppermute x{sends} per tick ({t.ticks} ticks; on average {useful / p:.0f} of a "
         f"device's {sends * t.ticks} sends carry data)": sends * t.ticks * act}
  ring = 2 * (p - 1) / p
  head = sum(math.prod(r.device_shape) * r.count for r in rows
             if r.role.head)
  out["grad all-reduce (final norm, head; chunk 0's input gradients)"] = int(ring * (head * 4 + (t.m + 1) * act))
  if cfg.pipeline.virtual_stages > 1:
    stack = sum(math.prod(r.device_shape) * r.count for r in rows if r.role.stacked)
    out["layer stack to chunks and grads back (all-to-all)"] = int(2 * (p - 1) * stack * 4)
  return out
