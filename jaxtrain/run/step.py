"""The train step, readable top to bottom, and the sharded setup around it (docs/training.md).
State: {"params": fp32 pure dict, "opt": optax state, "step": int32 applied updates, "loss_scale"}, and with
train.objective=dpo without LoRA "ref": the frozen reference (jaxtrain.run.dpo)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core import ramp
from jaxtrain.core.config import Config
from jaxtrain.core.errors import UserError
from jaxtrain.model import moe_balance, ops, quant, roles, transformer as model_lib
from jaxtrain.parallel import expert_layout as moe_layout, pipeline, placement as placement_lib, plan as plan_lib
from jaxtrain.parallel import data_region, sharding
from jaxtrain.run import dpo, grads as grads_lib, in_backward, offload as offload_lib, optimizer as optim_lib
from jaxtrain.run import precision, qk_clip
from jaxtrain.run.layout import Layout


def init_state(cfg: Config, opt: optax.GradientTransformation, params) -> dict:
  """The state around float32 `params`; with LoRA the frozen base in the compute dtype, moments for the adapters;
  with DPO the reference (jaxtrain.run.dpo: none of its own under LoRA, where it is the base without adapters)."""
  params = roles.stored(cfg.model, params)
  state = {"params": params, "opt": opt.init(roles.split(cfg.model, params)[0]), "step": jnp.zeros((), jnp.int32),
           "loss_scale": precision.init(cfg)}
  if optim_lib.in_tokens(cfg):  # the schedule's position: valid tokens of applied updates (optimizer.tokens_add)
    state["tokens"] = jnp.zeros((2,), jnp.int32)
  return {**state, "ref": dpo.reference(cfg.model, params)} if dpo.holds_reference(cfg) else state


def train_step(objective, opt, plan, layout: Layout, state, batch, executor=grads_lib.accumulate, opt_at=None):
  """One update; a step with non-finite gradients or update, or no valid token, moves nothing (the schedule's
  position included). `opt_at(lr)`: the update rule at this update's learning rate, where the step computes it
  (`optimizer.lr_in_step`: a schedule in tokens, or scaled by the batch)."""
  cfg = plan.cfg
  scale = state["loss_scale"]["scale"]
  if cfg.optim.in_backward:  # each layer's update inside the backward: no whole gradient
    with ops.use(plan):
      loss, grad_norm, n_valid, params, opt_state, apply = in_backward.update(objective, state, batch, scale)
    return _finish(cfg, state, params, opt_state, apply, loss, grad_norm, n_valid, scale, {},
                   jnp.isfinite(grad_norm) & jnp.isfinite(loss), None, None)
  with ops.use(plan):
    params = layout.compute(state["params"])
    if dpo.active(cfg):  # DPO: the frozen reference beside the policy
      loss, g, n_valid, extra = dpo.grads(objective, params, dpo.reference_of(state, params), batch, scale,
                                          layout.grad_sharding,
                                          executor)
    else:
      loss, g, n_valid, extra = grads_lib.grads(objective, params, batch, scale, layout.grad_sharding, executor)
    max_LxH = qk_clip.max_logits(objective, params, batch) if cfg.optim.qk_clip else None
  grad_norm = optax.tree.norm(g)  # unscaled, before the optimizer clips it: as logged
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)  # a non-finite element makes the norm non-finite
  ok = finite & (n_valid > 0)
  # aux-loss-free balancing: the routing biases move with an applied update (nothing when off)
  delta = moe_balance.bias_delta(cfg.model, extra.pop("moe_load", None))
  lr = optim_lib.learning_rate(cfg, state, n_valid, batch["inputs"].shape[0]) if optim_lib.lr_in_step(cfg) else None
  if lr is not None:
    opt = opt_at(lr)
  if layout.offload:  # master and moments in host memory, updated a unit at a time
    params, opt_state, apply = offload_lib.streamed_update(
        optim_lib.parts(cfg, lr=lr), (layout.device_state(), (layout.stored, layout.opt)), grad_norm,
        state["params"], state["opt"], g, ok, delta)
  else:  # LoRA: the adapters move, the frozen base passes through
    trained, frozen = roles.split(cfg.model, state["params"])
    safe = optim_lib.stays_finite(cfg, state["step"], trained, delta, lr)
    params, opt_state, apply = optim_lib.guarded_update(opt, trained, state["opt"], g, ok, delta, safe)
    if max_LxH is not None:  # MuonClip: the heads over tau rescaled after the update
      params = qk_clip.clip(cfg, params, max_LxH, apply)
    params = roles.join(params, frozen)
  return _finish(cfg, state, params, opt_state, apply, loss, grad_norm, n_valid, scale, extra, finite, lr, max_LxH)


def _finish(cfg, state, params, opt_state, apply, loss, grad_norm, n_valid, scale, extra, finite, lr, max_LxH):
  """The new state and the step's metrics (`lr`: the step's own learning rate, None: the schedule's by step;
  `max_LxH`: QK-clip's largest logits, None: off)."""
  new_state = {**state, "params": params, "opt": opt_state, "step": state["step"] + apply.astype(jnp.int32),
               "loss_scale": precision.update(cfg, state["loss_scale"], finite)}
  if "tokens" in state:  # a skipped update moves the schedule by nothing
    new_state["tokens"] = optim_lib.tokens_add(state["tokens"], jnp.where(apply, n_valid, 0))
  if lr is None:
    lr = optim_lib.lr_schedule(cfg.optim, cfg.train.steps)(state["step"])
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": n_valid, "skipped": ~apply, "loss_scale": scale}
  if cfg.model.moe_experts or dpo.active(cfg):
    metrics.update(extra)
  if max_LxH is not None:
    metrics.update(qk_clip.metrics(cfg, max_LxH))
  return new_state, metrics


def eval_step(objective, plan, layout: Layout, params, batch, executor=grads_lib.forward):
  with ops.use(plan):
    return grads_lib.evaluate(objective, layout.compute(params), batch, executor)


class Setup:
  """The model, optimizer, shardings and jitted functions of one (config, mesh). `cfg` is the plan's: the
  config with what the mesh implies set."""

  def __init__(self, cfg: Config, mesh, plan=None, segments: int | None = None, abstracts: dict | None = None):
    """`segments`: the most segments a row of the run's data holds (None: not known), for the attention path.
    `abstracts`: a cache of the abstract model per model config, shared by Setups of one model on many meshes (the
    planner): tracing the model's init is most of a Setup's time."""
    self.plan = plan or plan_lib.build(cfg, mesh, segments=segments)  # decided once; the model only follows it
    self.cfg, self.mesh = cfg, mesh = self.plan.cfg, mesh
    check_fits_mesh(cfg, mesh)
    self._abstracts = abstracts = {} if abstracts is None else abstracts
    key = (cfg.model, cfg.train.seed)
    if key not in abstracts:
      abstracts[key] = model_lib.abstract(cfg.model, cfg.train.seed)
    self.graphdef, abstract_state = abstracts[key]
    self.n_params, self.notes = model_lib.param_count(abstract_state), []
    self.abstract_params = abstract_state  # nnx.State of ShapeDtypeStructs with `axes` metadata
    self.param_shardings = sharding.param_shardings(abstract_state, mesh, self.notes)
    self.opt = optim_lib.optimizer(cfg)
    self.layout = layout = Layout(cfg, self.plan, self.opt, nnx.to_pure_dict(abstract_state), self.param_shardings,
                                  self.notes)
    # Muon gathers each matrix whole from its momentum's sharding (the stored layout's), which the layout decides
    self.opt = optim_lib.optimizer(cfg, layout.trained(layout.stored))
    replicated = NamedSharding(mesh, P())
    self.state_shardings = {"params": layout.stored, "opt": layout.opt, "step": replicated,
                            "loss_scale": {"scale": replicated, "good_steps": replicated},
                            **({"tokens": replicated} if optim_lib.in_tokens(cfg) else {}),
                            **({"ref": layout.param} if dpo.holds_reference(cfg) else {})}
    self.grad_shardings = layout.grads
    t = cfg.train
    self.placement = placement_lib.Placement(self.plan, t.batch_size, t.seq_len)
    self.batch_sharding = self.placement.sharding
    self.objective = objective = (dpo.Objective if dpo.active(cfg) else grads_lib.Objective)(self.graphdef, cfg)
    # mesh pipeline > 1: the microbatches' forward and backward run as the pipeline schedule says
    self.pipelined = pipeline.active(mesh)
    executor = pipeline.executor(cfg, mesh) if self.pipelined else grads_lib.accumulate
    if data_region.wanted(self.plan):  # gradients reduced over data once per update, not once per microbatch
      executor = data_region.once_over_data(executor)
    forward = pipeline.forward_executor(cfg, mesh) if self.pipelined else grads_lib.forward

    def init():
      params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(t.seed))))
      return init_state(cfg, self.opt, params)

    # Initializers run under jit with output shardings: each shard is created on its device.
    self.init = jax.jit(init, out_shardings=self.state_shardings)
    # LoRA on an imported base: fresh adapters alone (the base's initializers are dead code XLA drops)
    self.init_adapters = jax.jit(lambda: roles.split(cfg.model, init()["params"])[0],
                                 out_shardings=roles.split(cfg.model, layout.stored)[0])
    opt_at = functools.partial(optim_lib.optimizer, cfg, layout.trained(layout.stored))
    self.step = jax.jit(functools.partial(train_step, objective, self.opt, self.plan, layout, executor=executor,
                                          opt_at=opt_at),
                        in_shardings=(self.state_shardings, self.batch_sharding),
                        out_shardings=(self.state_shardings, replicated), donate_argnums=0)
    self.eval_step = jax.jit(functools.partial(eval_step, objective, self.plan, layout, executor=forward),
                             in_shardings=(layout.stored, self.batch_sharding), out_shardings=replicated)

  @functools.cached_property
  def state_shapes(self):
    """Shapes and dtypes of the train state, traced from the abstract parameters (not a second model init); the
    same for every mesh of one config, so kept in `abstracts` where there is one."""
    key = ("state", self.cfg)
    if key not in self._abstracts:
      self._abstracts[key] = jax.eval_shape(functools.partial(init_state, self.cfg, self.opt),
                                            nnx.to_pure_dict(self.abstract_params))
    return self._abstracts[key]

  def abstract_state(self):
    """Shapes, dtypes and shardings of the train state, without allocating it."""
    shapes = jax.eval_shape(self.init)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, self.state_shardings)

  def base_abstract(self, quantized: bool = False):
    """What this run takes from a parameters-only checkpoint (an import): every parameter, or under LoRA the
    frozen base alone (the adapters start fresh, `with_adapters`, as PEFT adds them to a base model), a weight that
    QLoRA quantizes as a dense float32 one unless the checkpoint holds it `quantized` (init_state quantizes it)."""
    params = self.abstract_state()["params"]
    if not self.cfg.model.lora_rank:
      return params
    base = roles.split(self.cfg.model, params)[1]
    if quantized:
      return base

    def dense(path, x):
      if not quant.is_quantized(x):
        return x
      keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
      at = lambda tree: functools.reduce(lambda t, k: t[k], keys, tree)  # noqa: E731
      return jax.ShapeDtypeStruct(at(self.layout.abstract_params).shape, jnp.float32, sharding=at(self.layout.param))
    return jax.tree_util.tree_map_with_path(dense, base, is_leaf=quant.is_quantized)

  def with_adapters(self, base):
    """`base` (`base_abstract`'s parameters) with LoRA's fresh adapters beside it."""
    return roles.join(self.init_adapters(), base) if self.cfg.model.lora_rank else base

  def init_from(self, params):
    """The train state around `params` (restored from a parameters-only checkpoint): the optimizer state, step
    and loss scale an import creates, exactly as `init` creates them around its own parameters."""
    make = jax.jit(lambda p: init_state(self.cfg, self.opt, p), out_shardings=self.state_shardings, donate_argnums=0)
    return make(params)

  def fresh_optimizer(self, kept):
    """The train state around `kept` (a checkpoint's state but its optimizer's, written by the other rule): this
    rule's state created as at step 0 (moments zero, their bias corrections from the start) but the schedule's
    count, which continues at the applied updates `kept["step"]` (as the lr logged from it)."""
    def make(kept):
      trained = roles.split(self.cfg.model, kept["params"])[0]
      at_step = lambda s: s._replace(count=kept["step"]) if isinstance(s, optax.ScaleByScheduleState) else s  # noqa: E731
      opt = jax.tree.map(at_step, self.opt.init(trained), is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
      return {**kept, "opt": opt}
    return jax.jit(make, out_shardings=self.state_shardings, donate_argnums=0)(kept)

  def device_batch(self, local: dict):
    return self.placement.device_batch(local)


def check_fits_mesh(cfg: Config, mesh) -> None:
  """Mesh-dependent config checks, as user errors."""
  t = cfg.train
  batch_ways = math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  for size in ramp.of(cfg).sizes():  # train.batch_size, or each size of train.batch_ramp
    per_micro = size // t.microbatches
    if per_micro % batch_ways:
      name = f"train.batch_ramp size {size}" if t.batch_ramp else f"train.batch_size={size}"
      raise UserError(f"{name} / train.microbatches={t.microbatches} = {per_micro} sequences per microbatch must "
                      f"divide over data*fsdp*expert={batch_ways} devices")
  if (x := cfg.model.moe_experts) and x % mesh.shape["expert"]:
    raise UserError(f"model.moe_experts={x} must divide over expert={mesh.shape['expert']} devices")
  if cfg.optim.in_backward and pipeline.active(mesh):
    raise UserError(f"optim.in_backward=true with mesh pipeline={mesh.shape['pipeline']} is not supported (the "
                    "update runs in the scan over a whole stack's layers); set optim.in_backward=false")
  if cfg.model.lora_rank and pipeline.active(mesh):
    raise UserError(f"model.lora_rank={cfg.model.lora_rank} with mesh pipeline={mesh.shape['pipeline']} is not "
                    "supported yet (LoRA runs on data, fsdp, tensor, sequence and expert axes)")
  if cfg.train.eval_tasks_interval and pipeline.active(mesh):
    raise UserError(f"train.eval_tasks={cfg.train.eval_tasks!r} with mesh pipeline={mesh.shape['pipeline']} is not "
                    "supported yet (lm-eval's model runs the whole stack on each device's layers); evaluate the "
                    "checkpoints with python -m jaxtrain.eval instead")
  pipeline.check(cfg, mesh)
  if cfg.optim.qk_clip and pipeline.active(mesh):
    raise UserError(f"optim.qk_clip={cfg.optim.qk_clip:g} with mesh pipeline={mesh.shape['pipeline']} is not "
                    "supported yet (its max-logit pass runs the layers outside the pipeline's schedule)")
  if t.seq_len % mesh.shape["sequence"]:
    raise UserError(f"train.seq_len={t.seq_len} must divide over sequence={mesh.shape['sequence']} devices")
  moe_layout.check(cfg, mesh)
  dpo.check(cfg, mesh)
