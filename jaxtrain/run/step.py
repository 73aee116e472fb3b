"""The train step, readable top to bottom, and the sharded setup around it (docs/training.md).
State: {"params": fp32 pure dict, "opt": optax state, "step": int32 applied updates, "loss_scale"}."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core import cpu_heap
from jaxtrain.core.config import Config, OptimConfig
from jaxtrain.core.errors import UserError
from jaxtrain.model import cpu_dots, loss as xent, moe_balance, mtp as mtp_lib, transformer as model_lib
from jaxtrain.parallel import expert_layout as moe_layout, pipeline, placement as placement_lib, plan as plan_lib
from jaxtrain.parallel import sharding
from jaxtrain.run import precision

# Decayed: projections only; not norm scales (a scale, not a direction) nor the embedding (rare rows would shrink).
DECAYED = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head",
                     "wq_a", "wq_b", "wkv_a", "wkv_b", "eh_proj"})  # MLA's and MTP's projections
# Weights the model casts to the compute dtype at every use: their compute copy is kept in that dtype.
CAST_AT_USE = DECAYED | {"embed"}


def lr_schedule(o: OptimConfig, steps: int) -> optax.Schedule:
  """By optimizer updates applied: linear warmup (lr/warmup, 2*lr/warmup, .., lr at update warmup-1),
  then cosine from lr at update `warmup` to lr*min_lr_ratio at update `steps`, held there after."""
  cosine = optax.cosine_decay_schedule(o.lr, max(steps - o.warmup_steps, 1), alpha=o.min_lr_ratio)
  if o.warmup_steps == 0:
    return cosine
  warmup = optax.linear_schedule(o.lr / o.warmup_steps, o.lr, o.warmup_steps - 1)  # 0 steps: constant lr
  return optax.join_schedules([warmup, cosine], [o.warmup_steps])


def decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in DECAYED, params)


def optimizer_parts(cfg: Config) -> tuple[float, optax.GradientTransformation]:
  """(the global-norm clip, 0: none; AdamW): `optimizer` chains them."""
  o = cfg.optim
  adamw = optax.adamw(lr_schedule(o, cfg.train.steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                      mask=decay_mask)
  return o.grad_clip, adamw


def optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW on the global-norm-clipped gradient (no clip when optim.grad_clip is 0). The state is AdamW's
  alone, the checkpoint layout the same either way (`optax.chain` would nest it one level down)."""
  max_norm, adamw = optimizer_parts(cfg)
  if max_norm <= 0:
    return adamw
  clip = optax.clip_by_global_norm(max_norm)

  def update(g, state, params=None):
    g, _ = clip.update(g, clip.init(g))
    return adamw.update(g, state, params)
  return optax.GradientTransformation(adamw.init, update)


def token_loss_sum(graphdef, params, mb, plan=None):
  """Sum (not mean) of next-token cross-entropy over the valid targets of a microbatch."""
  return token_loss_and_moe(graphdef, params, mb, plan)[0]


def token_loss_and_moe(graphdef, params, mb, plan=None, mtp: bool = False):
  """(token_loss_sum, the microbatch's MoE totals `moe_balance.totals`; zeros for a dense model, the summed
  multi-token-prediction loss; 0 unless `mtp`)."""
  model = nnx.merge(graphdef, params)
  plan = plan or plan_lib.local(model.cfg)
  h_BxLxD, moe_stats = model.hidden(mb["inputs"], mb["positions"], mb["segment_ids"], plan)
  loss_sum = xent.nll_sum(h_BxLxD, model.head_weight(), mb["targets"], mb["loss_mask"], plan, plan.loss_chunk_tokens)
  mtp_sum = (mtp_lib.loss_sum(model, h_BxLxD, mb, model_lib.rope_tables(mb["positions"], model.cfg), plan)[0]
             if mtp else jnp.float32(0))
  return loss_sum, moe_balance.totals(model.cfg, moe_stats), mtp_sum


def grads(graphdef, params, batch, microbatches: int, loss_scale=1.0, moe_metrics: bool = False, plan=None,
          grad_shardings=None):
  """(loss, unscaled gradient, n_valid[, MoE metrics]) of one update, accumulated over microbatches.
  Each microbatch's backward runs on (loss_sum + its share of the MoE aux) * loss_scale / n_valid
  (n_valid of the whole update): per-token gradients stay in float16 range and the summed gradient
  is already the token average. The loss returned is the cross-entropy alone; with moe_metrics
  `moe_balance.update_metrics` (moe_load: per layer and expert, for the aux-free bias) comes 4th.
  `grad_shardings` (ZeRO): each microbatch's gradient and the sum are kept in it (ZeRO-2: a reduce-scatter)."""
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  denom = jnp.maximum(n_valid, 1).astype(jnp.float32)
  keep = (lambda g: jax.lax.with_sharding_constraint(g, grad_shardings)) if grad_shardings else (lambda g: g)
  zeros = keep(jax.tree.map(jnp.zeros_like, params))
  m = nnx.merge(graphdef, params).cfg
  mtp_w = m.mtp_weight if m.mtp_layers else 0.0  # its mean over the update's MTP targets, weighted
  mtp_denom = jnp.maximum(jnp.sum(mtp_lib.targets(batch)[1] > 0), 1).astype(jnp.float32) if mtp_w else 1.0

  def scaled(p, mb):
    loss_sum, moe, mtp_sum = token_loss_and_moe(graphdef, p, mb, plan, mtp=bool(mtp_w))
    extra = moe["aux"] * denom / microbatches + mtp_w * mtp_sum * denom / mtp_denom
    return (loss_sum + extra) * (loss_scale / denom), (loss_sum, moe)

  def accumulate(carry, mb):
    loss_sum, grad_sum, moe_sum = carry
    (_, (l, moe)), g = jax.value_and_grad(scaled, has_aux=True)(params, mb)
    return (loss_sum + l, jax.tree.map(jnp.add, grad_sum, keep(g)), jax.tree.map(jnp.add, moe_sum, moe)), None

  moe0 = moe_balance.zero_totals(m)
  (loss_sum, grad_sum, moe), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros, moe0),
                                              placement_lib.split_microbatches(batch, microbatches, plan or plan_lib.local()))
  out = loss_sum / denom, jax.tree.map(lambda g: g / loss_scale, grad_sum), n_valid
  return (*out, moe_balance.update_metrics(moe, microbatches)) if moe_metrics else out


def eval_loss(graphdef, params, batch, microbatches: int, plan):
  """Loss-only pass: summed per-token loss and valid-token count of one batch, microbatched like
  the train step (it fits wherever training fits); sums, so batches add up exactly."""
  def accumulate(total, mb):
    return total + token_loss_sum(graphdef, params, mb, plan), None
  loss_sum, _ = jax.lax.scan(accumulate, jnp.float32(0), placement_lib.split_microbatches(batch, microbatches, plan))
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  return {"loss": loss_sum / jnp.maximum(n_valid, 1), "loss_sum": loss_sum, "tokens": n_valid}


def init_state(cfg: Config, opt: optax.GradientTransformation, params) -> dict:
  return {"params": params, "opt": opt.init(params), "step": jnp.zeros((), jnp.int32),
          "loss_scale": precision.init(cfg)}


def guarded_update(opt: optax.GradientTransformation, params, opt_state, g, ok):
  """(params, opt_state, applied): the update of `opt` when `ok` and the new params are finite, else
  the old values; one `lax.cond` between the two states, not an elementwise select per array."""
  updates, new_opt = opt.update(g, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  # e.g. a huge lr: finite gradients, overflowing params
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_params)]))
  return jax.lax.cond(ok & finite, lambda: (new_params, new_opt, True), lambda: (params, opt_state, False))


def _all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def streamed_update(parts, shardings, clip_norm, master, opt_state, g, ok):
  """`guarded_update` for master and moments in host memory (optim.offload=host) that brings one unit to the
  device at a time: each non-layer parameter, then each layer (a slice of the stack under scan_layers). The
  clip factor comes from the whole gradient first; AdamW's counts are shared, so each unit's update is the
  one optax makes on the whole tree. Two passes over the units, as the update is all or nothing: the first
  only learns whether every new parameter is finite, the second writes. `parts`: `optimizer_parts`;
  `shardings`: (device, host) shardings of (master, opt_state)."""
  max_norm, adamw = parts
  if max_norm > 0:  # optax's clip_by_global_norm, applied unit by unit: the clipped tree is never whole
    trigger = clip_norm < max_norm
    g = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / clip_norm.astype(t.dtype)) * max_norm), g)
  flat = lambda t, ks: jax.tree.flatten(t, is_leaf=lambda x: isinstance(x, dict) and x.keys() == ks)  # noqa: E731
  s_leaves, s_def = flat(opt_state, master.keys())
  (dev_m, dev_s), (host_m, host_s) = [(m, flat(st, master.keys())[0]) for m, st in shardings]
  sub = lambda leaves, pick: [pick(x) if isinstance(x, dict) else x for x in leaves]  # noqa: E731

  def unit(pick, pick_sh, m_tree, s_list, apply, after):
    """AdamW on what `pick` takes of a params-shaped dict, fetched once `after` (the previous unit's flag) is
    known; new (master, state leaves) back in host memory."""
    p, st = pick(m_tree), sub(s_list, pick)
    if after is not None:  # fori_loop's iterations are in order already (a barrier there costs a copy on CPU)
      p, st, _ = jax.lax.optimization_barrier((p, st, after))
    p, st = jax.device_put((p, st), (pick_sh(dev_m), sub(dev_s, pick_sh)))
    upd, new_st = adamw.update(pick(g), s_def.unflatten(st), p)
    new_p, new_st = optax.apply_updates(p, upd), flat(new_st, p.keys())[0]
    if apply is not None:
      new_p, new_st = jax.tree.map(lambda n, o: jnp.where(apply, n, o), (new_p, new_st), (p, st))
    return jax.device_put((new_p, new_st), (pick_sh(host_m), sub(host_s, pick_sh))), _all_finite(new_p)

  layers_of = lambda leaves: [x["layers"] for x in leaves if isinstance(x, dict)]  # noqa: E731
  stacked = not all(isinstance(k, int) for k in master["layers"])  # scan_layers: one stack per weight
  n = jax.tree.leaves(master["layers"])[0].shape[0] if stacked else len(master["layers"])

  def at(i):  # one layer of a params-shaped dict, and of a tree of its shardings
    if not stacked:
      return lambda d: {"layers": {i: d["layers"][i]}}, lambda d: {"layers": {i: d["layers"][i]}}
    take = lambda d: {"layers": jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False),  # noqa: E731
                                             d["layers"])}
    return take, lambda d: {"layers": jax.tree.map(
        lambda sh: NamedSharding(sh.mesh, P(*sh.spec[1:]), memory_kind=sh.memory_kind), d["layers"])}

  def layer(i, carry, apply):
    m_l, s_l, fin = carry
    it = iter(s_l)
    s_list = [{"layers": next(it)} if isinstance(x, dict) else x for x in s_leaves]
    (new_p, new_st), f = unit(*at(i), {"layers": m_l}, s_list, apply, None if stacked else fin)
    if apply is None:
      return m_l, s_l, fin & f
    new_p, new_l = new_p["layers"], layers_of(new_st)
    if not stacked:  # the layers dict, one layer replaced
      return {**m_l, i: new_p[i]}, [{**c, i: x[i]} for c, x in zip(s_l, new_l)], fin & f
    put = lambda c, x: jax.lax.dynamic_update_index_in_dim(c, x, i, 0)  # noqa: E731
    return jax.tree.map(put, m_l, new_p), jax.tree.map(put, s_l, new_l), fin & f

  def stream(apply):
    fin, rest_p, rest_s = jnp.bool_(True), {}, None
    for k in (k for k in master if k != "layers"):  # embedding, head, final norm: a unit each
      pick = lambda d, k=k: {k: d[k]}  # noqa: E731
      (p, st), f = unit(pick, pick, master, s_leaves, apply, fin)
      fin, rest_p = fin & f, {**rest_p, **p}
      rest_s = st if rest_s is None else [{**a, **b} if isinstance(a, dict) else a for a, b in zip(rest_s, st)]
    carry = (master["layers"], layers_of(s_leaves), fin)
    body = functools.partial(layer, apply=apply)
    if stacked:
      carry = jax.lax.fori_loop(0, n, body, carry)
    else:
      for i in master["layers"]:
        carry = body(i, carry)
    return rest_p, rest_s, carry

  apply = ok & stream(None)[2][2]
  rest_p, rest_s, (m_l, s_l, _) = stream(apply)
  it = iter(s_l)
  new_s = [{**x, "layers": next(it)} if isinstance(x, dict) else x for x in rest_s]
  return {**rest_p, "layers": m_l}, s_def.unflatten(new_s), apply


def compute_copy(params, shardings, dtype, fetch=None):
  """The parameters the step computes with, from the float32 master: weights cast at use taken in the
  compute `dtype` and brought to their compute `shardings` (an all-gather over data with ZeRO, a host
  to device copy with offload), then seen as float32 again. The model's own cast makes them exactly the
  values a float32 master gives, and the gradients (and their sums) are float32 as without it. `fetch`
  (offload): the master's own shardings in device memory, where it goes before the cast (XLA moves host
  arrays to and from the device; it runs no arithmetic on them outside `compute_on`)."""
  def low(path, p, sh, dev):
    p = p if fetch is None else jax.device_put(p, dev)
    return jax.device_put(p.astype(dtype) if getattr(path[-1], "key", None) in CAST_AT_USE else p, sh)
  # the barrier keeps the gathered copy whole: XLA would otherwise re-gather each layer at each use (ZeRO-3)
  copy = jax.lax.optimization_barrier(jax.tree_util.tree_map_with_path(low, params, shardings, fetch or shardings))
  copy = jax.lax.with_sharding_constraint(copy, shardings)  # the barrier's output too, else it may stay split
  return jax.tree.map(lambda c, p: c.astype(p.dtype), copy, params)


def train_step(graphdef, opt: optax.GradientTransformation, cfg: Config, plan, state, batch, grads_fn=None,
               compute=None, offload=None):
  """One update; a step with non-finite gradients or update, or no valid token, moves nothing.
  `grads_fn` (the contract of `grads`; the pipeline executor) replaces `grads`. `compute` maps the
  stored master to the parameters the step differentiates (`compute_copy`; None: the master itself);
  `offload` (`streamed_update` with its parts bound) updates host-resident master and moments."""
  t = cfg.train
  scale = state["loss_scale"]["scale"]
  grads_fn = grads_fn or functools.partial(grads, plan=plan)
  params = compute(state["params"]) if compute else state["params"]
  loss, g, n_valid, moe_metrics = grads_fn(graphdef, params, batch, t.microbatches, scale, moe_metrics=True)
  grad_norm = optax.tree.norm(g)  # unscaled, before the optimizer clips it: as logged
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)  # a non-finite element makes the norm non-finite
  if offload:  # master and moments in host memory, updated a unit at a time
    params, opt_state, apply = offload(state["params"], state["opt"], g, finite & (n_valid > 0), grad_norm)
  else:
    params, opt_state, apply = guarded_update(opt, state["params"], state["opt"], g, finite & (n_valid > 0))
  # aux-loss-free balancing: the routing bias moves after an applied update only (no-op when off)
  params = moe_balance.nudge(cfg.model, params, moe_metrics.pop("moe_load"), apply)
  new_state = {"params": params, "opt": opt_state, "step": state["step"] + apply.astype(jnp.int32),
               "loss_scale": precision.update(cfg, state["loss_scale"], finite)}
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(cfg.optim, t.steps)(state["step"]), "tokens": n_valid,
             "skipped": ~apply, "loss_scale": scale}
  if cfg.model.moe_experts:
    metrics.update(moe_metrics)
  return new_state, metrics


class Setup:
  """The model, optimizer, shardings and jitted functions of one (config, mesh)."""

  def __init__(self, cfg: Config, mesh, plan=None):
    self.cfg, self.mesh = cfg, mesh
    check_fits_mesh(cfg, mesh)
    cpu_dots.install()  # bfloat16 matmuls on XLA:CPU with float32 sums, as on GPUs: the fast CPU kernel
    if mesh.devices.flat[0].platform == "cpu":
      cpu_heap.keep()  # the step's temporaries reused, not mapped and zero-filled anew at every step
    self.plan = plan or plan_lib.build(cfg, mesh)  # decided once; the model only follows it
    self.graphdef, abstract_state = model_lib.abstract(cfg.model, cfg.train.seed)
    self.n_params, self.notes = model_lib.param_count(abstract_state), []
    self.abstract_params = abstract_state  # nnx.State of ShapeDtypeStructs with `axes` metadata
    param_sh = self.param_shardings = sharding.param_shardings(abstract_state, mesh, self.notes)
    self.opt = optimizer(cfg)
    replicated = NamedSharding(mesh, P())
    abstract_params = nnx.to_pure_dict(abstract_state)
    # the stored layout of master and moments (ZeRO-1/2: also over data; offload: in host memory)
    host = "pinned_host" if self.plan.offload == "host" else None
    store_sh = jax.tree_util.tree_map_with_path(
        lambda path, sh, x: sharding.storage_sharding(sh, x.shape, self.plan.zero_stage > 0, host, self.notes,
                                                      jax.tree_util.keystr(path, simple=True, separator="/")),
        param_sh, abstract_params)
    opt_sh = optax.tree_map_params(self.opt, lambda _, sh: sh, jax.eval_shape(self.opt.init, abstract_params),
                                   store_sh, transform_non_params=lambda _: replicated)
    self.state_shardings = {"params": store_sh, "opt": opt_sh, "step": replicated,
                            "loss_scale": {"scale": replicated, "good_steps": replicated}}
    self.separate_compute = self.plan.zero_stage > 0 or host is not None  # else the master is what the step uses
    on_device = lambda tree: jax.tree.map(lambda sh: sh.with_memory_kind("device"), tree)  # noqa: E731
    self.grad_shardings = on_device(store_sh) if self.plan.zero_stage == 2 else param_sh
    compute = (functools.partial(compute_copy, shardings=param_sh, dtype=cfg.model.dtype,
                                 fetch=on_device(store_sh) if host else None) if self.separate_compute else None)
    offload = (lambda p, o, g, ok, norm: streamed_update(
        optimizer_parts(cfg), (on_device((store_sh, opt_sh)), (store_sh, opt_sh)), norm, p, o, g, ok)) if host else None
    t = cfg.train
    self.placement = placement_lib.Placement(self.plan, t.batch_size, t.seq_len)
    self.batch_sharding = self.placement.sharding

    def init():
      params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(t.seed))))
      return init_state(cfg, self.opt, params)

    # mesh pipeline > 1: the update's gradients come from the pipeline schedule
    self.grads_fn = (pipeline.grads_fn(cfg, mesh, self.plan) if pipeline.active(mesh) else
                     functools.partial(grads, plan=self.plan, grad_shardings=self.grad_shardings)
                     if self.plan.zero_stage else None)  # pinned: XLA would split stage 1's too, from the update's

    def step(state, batch):
      return train_step(self.graphdef, self.opt, cfg, self.plan, state, batch, self.grads_fn, compute, offload)

    evaluate = functools.partial(pipeline.eval_loss, cfg=cfg, mesh=mesh) if pipeline.active(mesh) else eval_loss

    def eval_step(params, batch):
      return evaluate(self.graphdef, compute(params) if compute else params, batch, t.microbatches, self.plan)

    # Initializers run under jit with output shardings: each shard is created on its device.
    self.init = jax.jit(init, out_shardings=self.state_shardings)
    self.step = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                        out_shardings=(self.state_shardings, replicated), donate_argnums=0)
    self.eval_step = jax.jit(eval_step, in_shardings=(store_sh, self.batch_sharding), out_shardings=replicated)

  def abstract_state(self):
    """Shapes, dtypes and shardings of the train state, without allocating it."""
    shapes = jax.eval_shape(self.init)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, self.state_shardings)

  def device_batch(self, local: dict):
    return self.placement.device_batch(local)


def check_fits_mesh(cfg: Config, mesh) -> None:
  """Mesh-dependent config checks, as user errors."""
  t = cfg.train
  batch_ways = math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  per_micro = t.batch_size // t.microbatches
  if per_micro % batch_ways:
    raise UserError(f"train.batch_size={t.batch_size} / train.microbatches={t.microbatches} = {per_micro} sequences "
                    f"per microbatch must divide over data*fsdp*expert={batch_ways} devices")
  if (x := cfg.model.moe_experts) and x % mesh.shape["expert"]:
    raise UserError(f"model.moe_experts={x} must divide over expert={mesh.shape['expert']} devices")
  pipeline.check(cfg, mesh)
  if t.seq_len % mesh.shape["sequence"]:
    raise UserError(f"train.seq_len={t.seq_len} must divide over sequence={mesh.shape['sequence']} devices")
  if cfg.model.mtp_weight > 0 and pipeline.active(mesh):
    raise UserError(f"model.mtp_weight={cfg.model.mtp_weight}: the pipeline schedule does not run the multi-token "
                    f"prediction layer; use a mesh with pipeline=1 or model.mtp_weight=0")
  moe_layout.check(cfg, mesh)
