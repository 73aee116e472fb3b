"""The train step, readable top to bottom, and the sharded setup around it.

Train state: {"params": pure dict of fp32 arrays, "opt": optax state, "step": int32 count
of applied updates (the schedule position), "loss_scale": see `precision`}.
Loss contract: sum of per-token cross-entropy over valid tokens, divided by the number
of valid tokens in the WHOLE update (all microbatches, all data-parallel ranks). The
global view of jit makes "all ranks" automatic: the batch is one global array.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import model as model_lib
from jaxtrain import pipeline, precision, sharding
from jaxtrain.config import Config, TrainConfig
from jaxtrain.errors import UserError

BATCH_AXES = ("batch", "length")
# Weight decay applies to the projection matrices only: not to norm scales (they set a
# scale, not a direction) and not to the embedding table (rows of rare tokens would be
# pulled to zero between their rare updates).
DECAYED = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"})


def lr_schedule(t: TrainConfig):
  """Linear warmup (lr/warmup .. lr), then cosine to lr*min_lr_ratio at the last step.

  Its argument is the number of optimizer updates already applied.
  """
  def lr(count):
    s = jnp.asarray(count, jnp.float32)
    warm = t.lr * (s + 1) / max(t.warmup_steps, 1)
    progress = jnp.clip((s - t.warmup_steps) / max(t.steps - t.warmup_steps, 1), 0.0, 1.0)
    cosine = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(s < t.warmup_steps, warm, cosine)
  return lr


def decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in DECAYED, params)


def optimizer(t: TrainConfig) -> optax.GradientTransformation:
  return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask)


def token_loss_sum(graphdef, params, mb):
  """Sum (not mean) of next-token cross-entropy over the valid targets of a microbatch."""
  return token_loss_and_moe(graphdef, params, mb)[0]


def token_loss_and_moe(graphdef, params, mb):
  """(token_loss_sum, MoE totals of the microbatch: aux loss averaged over MoE layers,
  dropped and assigned token-to-expert assignments; zeros for a dense model)."""
  logits_BxLxV, moe_stats = nnx.merge(graphdef, params).forward(mb["inputs"], mb["positions"], mb["segment_ids"])
  target_logit_BxL = jnp.take_along_axis(logits_BxLxV, mb["targets"][..., None], axis=-1)[..., 0]
  nll_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_logit_BxL
  moe = {k: sum((s[k] for s in moe_stats), jnp.float32(0)) for k in ("aux", "dropped", "assigned")}
  moe["aux"] = moe["aux"] / max(len(moe_stats), 1)
  return jnp.sum(nll_BxL * mb["loss_mask"].astype(jnp.float32)), moe


def split_microbatches(batch, k: int):
  """(B, L) -> (k, B/k, L), microbatch i = rows i, i+k, ... so no row changes device."""
  def split(x_BxL):
    B, L = x_BxL.shape
    x_kxbxL = x_BxL.reshape(B // k, k, L).swapaxes(0, 1)
    return sharding.constrain(x_kxbxL, (None, "batch", "length"))
  return jax.tree.map(split, batch)


def grads(graphdef, params, batch, microbatches: int, loss_scale=1.0, moe_metrics: bool = False):
  """Token-normalized loss and (unscaled) gradient of one update, accumulated over microbatches.

  The valid-token count of the whole update is known before any microbatch runs, so
  each microbatch's backward pass runs on loss_sum * loss_scale / n_valid: per-token
  gradients are O(loss_scale / n_valid), in float16 range, and the summed gradient is
  already the token average. Dividing by loss_scale at the end unscales it.

  MoE: the objective differentiated is loss + (mean over microbatches of the
  microbatch's aux loss, itself the mean over MoE layers); the returned loss is the
  cross-entropy alone. With moe_metrics=True a 4th value holds `moe_aux_loss` and
  `moe_dropped_frac` (dropped / all token-to-expert assignments of the update).
  """
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  denom = jnp.maximum(n_valid, 1).astype(jnp.float32)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def scaled(p, mb):
    loss_sum, moe = token_loss_and_moe(graphdef, p, mb)
    return (loss_sum + moe["aux"] * denom / microbatches) * (loss_scale / denom), (loss_sum, moe)

  def accumulate(carry, mb):
    loss_sum, grad_sum, moe_sum = carry
    (_, (l, moe)), g = jax.value_and_grad(scaled, has_aux=True)(params, mb)
    return (loss_sum + l, jax.tree.map(jnp.add, grad_sum, g), jax.tree.map(jnp.add, moe_sum, moe)), None

  moe0 = {k: jnp.float32(0) for k in ("aux", "dropped", "assigned")}
  (loss_sum, grad_sum, moe), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros, moe0),
                                              split_microbatches(batch, microbatches))
  out = loss_sum / denom, jax.tree.map(lambda g: g / loss_scale, grad_sum), n_valid
  if not moe_metrics:
    return out
  return *out, {"moe_aux_loss": moe["aux"] / microbatches,
                "moe_dropped_frac": moe["dropped"] / jnp.maximum(moe["assigned"], 1.0)}


def eval_loss(graphdef, params, batch, microbatches: int):
  """Loss-only pass: summed per-token loss and valid-token count of one batch (microbatched
  like the train step, so it fits wherever training fits). Sums, so batches add up exactly."""
  def accumulate(total, mb):
    return total + token_loss_sum(graphdef, params, mb), None
  loss_sum, _ = jax.lax.scan(accumulate, jnp.float32(0), split_microbatches(batch, microbatches))
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  return {"loss": loss_sum / jnp.maximum(n_valid, 1), "loss_sum": loss_sum, "tokens": n_valid}


def global_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def init_state(cfg: Config, opt: optax.GradientTransformation, params) -> dict:
  return {"params": params, "opt": opt.init(params), "step": jnp.zeros((), jnp.int32),
          "loss_scale": precision.init(cfg)}


def train_step(graphdef, opt: optax.GradientTransformation, cfg: Config, state, batch, grads_fn=None):
  """One update. A step whose gradients are not all finite (or that has no valid token)
  moves nothing: params, Adam state and the schedule position (`step`) stay as they were.
  `grads_fn` (same contract as `grads`) replaces it, e.g. by the pipeline executor."""
  t = cfg.train
  scale = state["loss_scale"]["scale"]
  loss, g, n_valid, moe_metrics = (grads_fn or grads)(graphdef, state["params"], batch, t.microbatches, scale,
                                                      moe_metrics=True)
  grad_norm = global_norm(g)  # before clipping, as logged
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)  # a non-finite element makes the norm non-finite
  if t.grad_clip > 0:
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, t.grad_clip / (grad_norm + 1e-6)), g)
  updates, opt_state = opt.update(g, state["opt"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  apply = finite & (n_valid > 0)
  keep = lambda new, old: jnp.where(apply, new, old)  # noqa: E731
  new_state = {
      "params": jax.tree.map(keep, params, state["params"]),
      "opt": jax.tree.map(keep, opt_state, state["opt"]),
      "step": state["step"] + apply.astype(jnp.int32),
      "loss_scale": precision.update(cfg, state["loss_scale"], finite),
  }
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(t)(state["step"]), "tokens": n_valid,
             "skipped": ~apply, "loss_scale": scale}
  if cfg.model.moe_experts:
    metrics.update(moe_metrics)
  return new_state, metrics


class Setup:
  """The model, optimizer, shardings and jitted functions of one (config, mesh)."""

  def __init__(self, cfg: Config, mesh):
    self.cfg, self.mesh = cfg, mesh
    check_fits_mesh(cfg, mesh)
    self.graphdef, abstract_state = model_lib.abstract(cfg.model, cfg.train.seed)
    self.n_params = model_lib.param_count(abstract_state)
    self.abstract_params = abstract_state  # nnx.State of ShapeDtypeStructs with `axes` metadata
    self.notes: list[str] = []
    param_sh = sharding.param_shardings(abstract_state, mesh, self.notes)
    self.opt = optimizer(cfg.train)
    replicated = NamedSharding(mesh, P())
    abstract_params = nnx.to_pure_dict(abstract_state)
    opt_sh = optax.tree_map_params(self.opt, lambda _, sh: sh, jax.eval_shape(self.opt.init, abstract_params),
                                   param_sh, transform_non_params=lambda _: replicated)
    self.state_shardings = {"params": param_sh, "opt": opt_sh, "step": replicated,
                            "loss_scale": {"scale": replicated, "good_steps": replicated}}
    t = cfg.train
    self.batch_sharding = sharding.logical_sharding(mesh, BATCH_AXES, (t.batch_size, t.seq_len))

    def init():
      params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(t.seed))))
      return init_state(cfg, self.opt, params)

    # mesh pipeline > 1: the update's gradients come from the pipeline schedule
    self.grads_fn = pipeline.grads_fn(cfg, mesh) if pipeline.active(mesh) else None

    def step(state, batch):
      with sharding.active_mesh(mesh, sequence_parallel=cfg.train.sequence_parallel):
        return train_step(self.graphdef, self.opt, cfg, state, batch, self.grads_fn)

    def eval_step(params, batch):
      with sharding.active_mesh(mesh):
        return eval_loss(self.graphdef, params, batch, t.microbatches)

    # Initializers run under jit with output shardings: each shard is created on its device.
    self.init = jax.jit(init, out_shardings=self.state_shardings)
    self.step = jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                        out_shardings=(self.state_shardings, replicated), donate_argnums=0)
    self.eval_step = jax.jit(eval_step, in_shardings=(param_sh, self.batch_sharding), out_shardings=replicated)

  def abstract_state(self):
    """Shapes, dtypes and shardings of the train state, without allocating it."""
    shapes = jax.eval_shape(self.init)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, self.state_shardings)

  def local_rows(self) -> tuple[int, int]:
    """(block, blocks): this process feeds rows [block*B/blocks, (block+1)*B/blocks) of
    each global batch, exactly the rows its devices hold (processes that share rows,
    e.g. when `tensor` spans hosts, feed the same block)."""
    B, L = self.cfg.train.batch_size, self.cfg.train.seq_len
    spans = {(ix[0].start or 0, B if ix[0].stop is None else ix[0].stop)
             for ix in self.batch_sharding.addressable_devices_indices_map((B, L)).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    size = hi - lo
    if B % size or lo % size or sum(b - a for a, b in spans) < size:
      raise UserError(f"this process's devices hold batch rows {sorted(spans)}, not one contiguous block; "
                      "put the batch axes (data, fsdp, expert) outside the axes that span hosts")
    return lo // size, B // size

  def device_batch(self, local: dict):
    """This process's rows -> global arrays sharded over the batch axes."""
    shape = (self.cfg.train.batch_size, self.cfg.train.seq_len)
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v, shape) for k, v in local.items()}


def check_fits_mesh(cfg: Config, mesh) -> None:
  """Mesh-dependent config checks, as user errors."""
  t = cfg.train
  batch_ways = math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  per_micro = t.batch_size // t.microbatches
  if per_micro % batch_ways:
    raise UserError(f"train.batch_size={t.batch_size} / train.microbatches={t.microbatches} = {per_micro} sequences "
                    f"per microbatch must divide over data*fsdp*expert={batch_ways} devices")
  m = cfg.model
  if m.moe_experts and m.moe_experts % mesh.shape["expert"]:
    raise UserError(f"model.moe_experts={m.moe_experts} must divide over expert={mesh.shape['expert']} devices")
  pipeline.check(cfg, mesh)
  if t.seq_len % mesh.shape["sequence"]:
    raise UserError(f"train.seq_len={t.seq_len} must divide over sequence={mesh.shape['sequence']} devices")
